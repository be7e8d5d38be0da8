//! The CUDA backend: every call into the CUDA driver and NVRTC that kvfence makes is here.
//!
//! The libraries are loaded at run time (cudarc's dynamic loading): building needs no CUDA
//! toolkit, and a binary starts on a host without one. cudarc panics when a call is made and
//! the library is missing, so every entry point first asks [`probe`], which refuses with
//! [`CudaError::NoDriver`] or [`CudaError::NoNvrtc`] naming the library.
//!
//! - [`CudaDevice`]: a context and stream on one GPU, and the page digest kernel compiled
//!   for it with NVRTC.
//! - [`CudaMemory`]: a worker's pool, allocated with the virtual memory API (`cuMemCreate`)
//!   as a shareable POSIX fd, zeroed, mapped read-write for its own device only, and usable
//!   by GPUDirect RDMA (a dmabuf fd of the range, for `ibv_reg_dmabuf_mr`).
//! - [`CudaForeignPool`]: decode's read-only mapping of prefill's pool, imported from that
//!   fd (`cuMemImportFromShareableHandle`, `cuMemSetAccess` with `PROT_READ` only), and the
//!   pull out of it: one `cuMemcpyDtoDAsync` per run of contiguous pages
//!   ([`plan::copy_runs`]), then the digest kernel over what landed.
//!
//! The digest kernel computes exactly [`page_digest`](crate::verify::page_digest) (crc32c),
//! so decode's verification is the same whatever the backend: one block per page, each
//! thread a segment, combined as [`plan::segmented_digest`] does on the host.
//!
//! Host-side decisions (which ranges to copy, ownership, page accounting) are made before
//! any call here, in [`plan`] and [`crate::pool`], and tested on host memory.

use super::{DeviceMemory, PoolMemory, PullError, plan};
use crate::ids::{PageId, PoolOffset};
use crate::pool::DeviceLanding;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg, result, sys,
};
use std::ffi::{c_int, c_void};
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

/// The CUDA driver library a host with an NVIDIA driver has.
pub const DRIVER_LIBRARY: &str = "libcuda.so.1";
/// The NVRTC library the page digest kernel is compiled with (the CUDA 12 runtime compiler).
pub const NVRTC_LIBRARY: &str = "libnvrtc.so.12";
/// The page digest kernel's entry point.
const DIGEST_KERNEL: &str = "kvfence_page_crc32c";

/// Why a CUDA operation failed or was refused.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver can be loaded.
    #[error(
        "the CUDA driver library {DRIVER_LIBRARY} cannot be loaded: no NVIDIA driver is \
         installed on this host, or it is not on the loader path"
    )]
    NoDriver,
    /// No NVRTC can be loaded (the digest kernel is compiled at start).
    #[error(
        "the CUDA runtime compiler {NVRTC_LIBRARY} (NVRTC, which builds the GPU page digest) \
         cannot be loaded: install the CUDA 12 NVRTC library, or put it on the loader path"
    )]
    NoNvrtc,
    /// The configured ordinal is not a device of this host.
    #[error("CUDA device {ordinal} does not exist: the driver sees {count} device(s)")]
    NoSuchDevice { ordinal: u32, count: u32 },
    /// The device lacks a capability the pools need.
    #[error("CUDA device {ordinal} does not support {what}")]
    Unsupported { ordinal: u32, what: &'static str },
    /// A driver call failed.
    #[error("{call}")]
    Driver {
        call: &'static str,
        #[source]
        source: DriverError,
    },
    /// NVRTC refused the page digest kernel.
    #[error("compiling the GPU page digest kernel")]
    Compile(#[source] cudarc::nvrtc::CompileError),
    /// A pull was refused before anything was copied.
    #[error("pull refused")]
    Pull(#[source] PullError),
    /// An offset, length or device that does not fit the memory it is for.
    #[error("{what}")]
    OutOfRange { what: &'static str },
}

impl CudaError {
    /// Whether the host lacks something (a library, a device, a capability) rather than an
    /// operation having failed: a configuration that asks for it cannot start here.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CudaError::NoDriver
                | CudaError::NoNvrtc
                | CudaError::NoSuchDevice { .. }
                | CudaError::Unsupported { .. }
        )
    }
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { call, source }
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(driver(call))
}

fn to_usize(v: u64, what: &'static str) -> Result<usize, CudaError> {
    usize::try_from(v).map_err(|_| CudaError::OutOfRange { what })
}

/// Whether the CUDA driver library can be loaded on this host.
pub fn driver_present() -> bool {
    // SAFETY: this only tries to dlopen the driver library under its usual names and closes
    // it again; loading it runs its initialisers, as any CUDA program does.
    unsafe { sys::is_culib_present() }
}

/// Whether NVRTC can be loaded on this host.
pub fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`, for the NVRTC library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// What [`probe`] found about one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: u32,
    pub name: String,
    pub total_bytes: u64,
    /// `cuMemCreate` and friends (the pools need them).
    pub vmm: bool,
    /// Allocations exportable as POSIX fds (decode maps prefill's pool through one).
    pub posix_fd: bool,
    /// VMM allocations usable by GPUDirect RDMA.
    pub rdma_vmm: bool,
    /// dmabuf export of device memory (`ibv_reg_dmabuf_mr`).
    pub dmabuf: bool,
}

/// Checks, without allocating anything, that device `ordinal` can hold a pool: the driver
/// and NVRTC load, the device exists, and it has the virtual memory API with POSIX fd
/// handles. Never panics on a host without CUDA.
pub fn probe(ordinal: u32) -> Result<DeviceInfo, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    result::init().map_err(driver("cuInit"))?;
    let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    let count = u32::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    let as_int =
        c_int::try_from(ordinal).map_err(|_| CudaError::NoSuchDevice { ordinal, count })?;
    let dev = result::device::get(as_int).map_err(driver("cuDeviceGet"))?;
    let name = result::device::get_name(dev).map_err(driver("cuDeviceGetName"))?;
    // SAFETY: `dev` is a device handle the driver just returned.
    let total = unsafe { result::device::total_mem(dev) }.map_err(driver("cuDeviceTotalMem"))?;
    let attr = |a: sys::CUdevice_attribute| -> Result<bool, CudaError> {
        // SAFETY: as above; the attribute is one this driver version defines.
        let v = unsafe { result::device::get_attribute(dev, a) }
            .map_err(driver("cuDeviceGetAttribute"))?;
        Ok(v != 0)
    };
    use sys::CUdevice_attribute as A;
    let info = DeviceInfo {
        ordinal,
        name,
        total_bytes: total as u64,
        vmm: attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?,
        posix_fd: attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?,
        rdma_vmm: attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)?,
        dmabuf: attr(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)?,
    };
    if !info.vmm {
        return Err(CudaError::Unsupported {
            ordinal,
            what: "the virtual memory management API",
        });
    }
    if !info.posix_fd {
        return Err(CudaError::Unsupported {
            ordinal,
            what: "POSIX file descriptor handles",
        });
    }
    Ok(info)
}

/// The CUDA C source of the page digest kernel, with the tables of [`plan`] written in.
pub fn digest_kernel_source() -> String {
    let x2n: Vec<String> = plan::x2n_table()
        .iter()
        .map(|v| format!("{v:#010x}u"))
        .collect();
    format!(
        r#"
#define THREADS {threads}
#define POLY 0x82f63b78u
__constant__ unsigned int X2N[32] = {{ {x2n} }};

__device__ unsigned int multmodp(unsigned int a, unsigned int b) {{
    unsigned int m = 1u << 31, p = 0;
    for (;;) {{
        if (a & m) {{
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }}
        m >>= 1;
        if (m == 0) break;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }}
    return p;
}}

__device__ unsigned int shift(unsigned int crc, unsigned long long n) {{
    unsigned int p = 1u << 31;
    unsigned int k = 3;
    while (n) {{
        if (n & 1) p = multmodp(X2N[k & 31], p);
        n >>= 1;
        k++;
    }}
    return multmodp(p, crc);
}}

extern "C" __global__ void {name}(const unsigned char *base,
        const unsigned long long *offsets, unsigned long long page_bytes,
        unsigned long long seg, unsigned int *out, unsigned int pages) {{
    __shared__ unsigned int tab[8][256];
    __shared__ unsigned int crc[THREADS];
    __shared__ unsigned long long len[THREADS];
    unsigned int t = threadIdx.x;
    for (unsigned int i = t; i < 256; i += blockDim.x) {{
        unsigned int c = i;
        for (int j = 0; j < 8; j++) c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        tab[0][i] = c;
    }}
    __syncthreads();
    for (int k = 1; k < 8; k++) {{
        for (unsigned int i = t; i < 256; i += blockDim.x) {{
            unsigned int prev = tab[k - 1][i];
            tab[k][i] = (prev >> 8) ^ tab[0][prev & 0xff];
        }}
        __syncthreads();
    }}
    unsigned int page = blockIdx.x;
    if (page >= pages) return;
    const unsigned char *p = base + offsets[page];
    unsigned long long start = (unsigned long long)t * seg;
    if (start > page_bytes) start = page_bytes;
    unsigned long long end = start + seg;
    if (end > page_bytes) end = page_bytes;
    unsigned int c = 0;
    unsigned long long i = start;
    if ((((unsigned long long)(p + i)) & 7) == 0) {{
        for (; i + 8 <= end; i += 8) {{
            unsigned long long w = *(const unsigned long long *)(p + i);
            unsigned int lo = c ^ (unsigned int)w;
            unsigned int hi = (unsigned int)(w >> 32);
            c = tab[7][lo & 0xff] ^ tab[6][(lo >> 8) & 0xff] ^ tab[5][(lo >> 16) & 0xff]
              ^ tab[4][lo >> 24] ^ tab[3][hi & 0xff] ^ tab[2][(hi >> 8) & 0xff]
              ^ tab[1][(hi >> 16) & 0xff] ^ tab[0][hi >> 24];
        }}
    }}
    for (; i < end; i++) c = tab[0][(c ^ p[i]) & 0xff] ^ (c >> 8);
    crc[t] = c;
    len[t] = end - start;
    for (unsigned int s = 1; s < THREADS; s <<= 1) {{
        __syncthreads();
        if ((t % (2 * s)) == 0 && t + s < THREADS && len[t + s] > 0) {{
            crc[t] = shift(crc[t], len[t + s]) ^ crc[t + s];
            len[t] += len[t + s];
        }}
    }}
    if (t == 0) out[page] = crc[0] ^ shift(0xffffffffu, page_bytes) ^ 0xffffffffu;
}}
"#,
        threads = plan::DIGEST_THREADS,
        x2n = x2n.join(", "),
        name = DIGEST_KERNEL,
    )
}

/// A context and stream on one GPU, with the page digest kernel loaded.
pub struct CudaDevice {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    digest: CudaFunction,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens device `ordinal` ([`probe`] first, so a host without CUDA gets an error, not
    /// a panic) and compiles the digest kernel for it.
    pub fn open(ordinal: u32) -> Result<Arc<CudaDevice>, CudaError> {
        let info = probe(ordinal)?;
        let ctx = CudaContext::new(ordinal as usize).map_err(driver("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let ptx = cudarc::nvrtc::compile_ptx(digest_kernel_source()).map_err(CudaError::Compile)?;
        let module = ctx.load_module(ptx).map_err(driver("cuModuleLoadData"))?;
        let digest = module
            .load_function(DIGEST_KERNEL)
            .map_err(driver("cuModuleGetFunction"))?;
        Ok(Arc::new(CudaDevice {
            info,
            ctx,
            stream,
            digest,
        }))
    }

    /// What [`probe`] found.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn ordinal(&self) -> u32 {
        self.info.ordinal
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
    }

    fn sync(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }

    /// crc32c of each page of `page_bytes` at `offsets` of the `region_len` bytes at device
    /// address `base`, computed by the digest kernel. Refuses a page outside the region
    /// before launching anything.
    fn digest(
        &self,
        base: u64,
        region_len: u64,
        offsets: &[PoolOffset],
        page_bytes: u64,
    ) -> Result<Vec<u32>, CudaError> {
        if offsets.is_empty() {
            return Ok(Vec::new());
        }
        for o in offsets {
            if o.0
                .checked_add(page_bytes)
                .is_none_or(|end| end > region_len)
            {
                return Err(CudaError::OutOfRange {
                    what: "a page to digest is outside the device memory",
                });
            }
        }
        let pages = u32::try_from(offsets.len()).map_err(|_| CudaError::OutOfRange {
            what: "more than 2^32 pages to digest",
        })?;
        let seg = plan::segment_bytes(page_bytes);
        let offs: Vec<u64> = offsets.iter().map(|o| o.0).collect();
        self.bind()?;
        let d_offs = self
            .stream
            .clone_htod(&offs)
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        let mut d_out = self
            .stream
            .alloc_zeros::<u32>(offs.len())
            .map_err(driver("cuMemAllocAsync"))?;
        let cfg = LaunchConfig {
            grid_dim: (pages, 1, 1),
            block_dim: (plan::DIGEST_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.digest);
        launch
            .arg(&base)
            .arg(&d_offs)
            .arg(&page_bytes)
            .arg(&seg)
            .arg(&mut d_out)
            .arg(&pages);
        // SAFETY: the arguments match the kernel's parameters in order and type (a device
        // address, a device array of `pages` u64 offsets, u64, u64, a device array of `pages`
        // u32, u32); every page it reads, `base + offset .. + page_bytes`, is inside the
        // region (checked above), which the caller keeps mapped until this returns (it
        // synchronizes the stream below).
        unsafe { launch.launch(cfg) }.map_err(driver("cuLaunchKernel"))?;
        let out = self
            .stream
            .clone_dtoh(&d_out)
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        self.sync()?;
        Ok(out)
    }
}

/// Allocation properties of a pool on device `ordinal`: pinned device memory, exportable
/// as a POSIX fd, usable by GPUDirect RDMA when the device supports it with VMM.
fn allocation_prop(ordinal: u32, rdma: bool) -> Result<sys::CUmemAllocationProp, CudaError> {
    let id = c_int::try_from(ordinal).map_err(|_| CudaError::OutOfRange {
        what: "device ordinal",
    })?;
    Ok(sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: device_location(id),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(rdma),
            usage: 0,
            reserved: [0; 4],
        },
    })
}

fn device_location(id: c_int) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id,
    }
}

fn granularity(prop: &sys::CUmemAllocationProp) -> Result<u64, CudaError> {
    let mut g = 0usize;
    // SAFETY: `g` and `prop` are valid for the call; the driver writes one usize.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok((g as u64).max(1))
}

/// A physical allocation mapped at a reserved range of this process's device addresses;
/// unmapped, freed and released on drop, in that order.
struct Mapping {
    dev: Arc<CudaDevice>,
    handle: sys::CUmemGenericAllocationHandle,
    va: sys::CUdeviceptr,
    size: usize,
    reserved: bool,
    mapped: bool,
}

impl Mapping {
    /// Reserves `size` bytes of addresses and maps `handle` there with `access` for the
    /// device of `dev`. The mapping owns `handle` from here on, error or not.
    fn map(
        dev: &Arc<CudaDevice>,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
        access: sys::CUmemAccess_flags,
    ) -> Result<Mapping, CudaError> {
        let mut m = Mapping {
            dev: dev.clone(),
            handle,
            va: 0,
            size,
            reserved: false,
            mapped: false,
        };
        // SAFETY: `m.va` is valid for the driver to write one device address; no fixed
        // address is asked for (0), so nothing already mapped can be replaced.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut m.va, size, 0, 0, 0)
        })?;
        m.reserved = true;
        // SAFETY: `m.va .. + size` was just reserved by us and holds no mapping; `handle` is
        // a live allocation of at least `size` bytes (the caller's contract, and the driver
        // refuses a shorter one).
        check("cuMemMap", unsafe {
            sys::cuMemMap(m.va, size, 0, handle, 0)
        })?;
        m.mapped = true;
        let id = c_int::try_from(dev.ordinal()).map_err(|_| CudaError::OutOfRange {
            what: "device ordinal",
        })?;
        let desc = sys::CUmemAccessDesc {
            location: device_location(id),
            flags: access,
        };
        // SAFETY: the range is the one mapped above; `desc` is one valid descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(m.va, size, &desc, 1)
        })?;
        Ok(m)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Err(e) = self.dev.bind() {
            log::warn!("releasing CUDA pool memory: {e}");
        }
        // Nothing may still read or write the range: wait for the stream's work first.
        if let Err(e) = self.dev.sync() {
            log::warn!("releasing CUDA pool memory: {e}");
        }
        let mut results = Vec::with_capacity(3);
        if self.mapped {
            // SAFETY: the range was mapped by `map` and is unmapped once, here; no work on
            // the stream uses it any more (synchronized above).
            results.push(("cuMemUnmap", unsafe { sys::cuMemUnmap(self.va, self.size) }));
        }
        if self.reserved {
            // SAFETY: the range was reserved by `map` and is freed once, here, unmapped.
            results.push(("cuMemAddressFree", unsafe {
                sys::cuMemAddressFree(self.va, self.size)
            }));
        }
        // SAFETY: the mapping owns `handle` and releases it once, here, after the unmap.
        results.push(("cuMemRelease", unsafe { sys::cuMemRelease(self.handle) }));
        for (call, r) in results {
            if let Err(e) = check(call, r) {
                log::warn!("releasing CUDA pool memory: {}", crate::error_chain(&e));
            }
        }
    }
}

/// A worker's pool in device memory: zeroed at creation, read-write for its own device,
/// exportable to another process on this host as a POSIX fd, registrable for GPUDirect
/// RDMA through a dmabuf fd.
pub struct CudaMemory {
    map: Mapping,
    len: u64,
    export: OwnedFd,
}

impl fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaMemory")
            .field("device", &self.map.dev.ordinal())
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl CudaMemory {
    /// Allocates `len` bytes (rounded up to the allocation granularity) on `dev`.
    pub fn new(dev: &Arc<CudaDevice>, len: u64) -> Result<CudaMemory, CudaError> {
        if len == 0 {
            return Err(CudaError::OutOfRange {
                what: "a pool of no bytes",
            });
        }
        dev.bind()?;
        let prop = allocation_prop(dev.ordinal(), dev.info.rdma_vmm)?;
        let size = to_usize(
            len.checked_next_multiple_of(granularity(&prop)?)
                .ok_or(CudaError::OutOfRange {
                    what: "pool size overflows",
                })?,
            "pool larger than the address space",
        )?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is valid for the driver to write; `prop` is fully initialised.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &prop, 0)
        })?;
        let map = Mapping::map(
            dev,
            handle,
            size,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        )?;
        let mut fd: c_int = -1;
        // SAFETY: for a POSIX fd handle type the driver writes one int through the pointer;
        // `handle` is the live allocation the mapping owns.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&raw mut fd).cast::<c_void>(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError::OutOfRange {
                what: "the driver exported no fd",
            });
        }
        // SAFETY: the driver just created `fd` for us; nothing else owns it.
        let export = unsafe { OwnedFd::from_raw_fd(fd) };
        // Device memory is not zeroed by the driver: a new pool must not show a former
        // process's data (stale GPU memory leaks across processes otherwise).
        // SAFETY: the whole mapped range, read-write for this device, synchronized below.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(map.va, 0, size, dev.stream.cu_stream())
        })?;
        dev.sync()?;
        Ok(CudaMemory { map, len, export })
    }

    /// The device the memory is on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.map.dev
    }

    fn range(&self, offset: PoolOffset, len: u64) -> Result<sys::CUdeviceptr, CudaError> {
        match offset.0.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.map.va + offset.0),
            _ => Err(CudaError::OutOfRange {
                what: "bytes outside the device pool",
            }),
        }
    }
}

impl PoolMemory for CudaMemory {
    fn len(&self) -> u64 {
        self.len
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }

    fn share_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> Option<&dyn DeviceMemory> {
        Some(self)
    }
}

impl DeviceMemory for CudaMemory {
    fn ordinal(&self) -> u32 {
        self.map.dev.ordinal()
    }

    fn device_addr(&self) -> u64 {
        self.map.va
    }

    fn digest_pages(&self, offsets: &[PoolOffset], page_bytes: u64) -> Result<Vec<u32>, CudaError> {
        self.map
            .dev
            .digest(self.map.va, self.len, offsets, page_bytes)
    }

    fn fill(&self, offset: PoolOffset, len: u64, pattern: &[u8; 16]) -> Result<(), CudaError> {
        let at = self.range(offset, len)?;
        let dev = &self.map.dev;
        dev.bind()?;
        let stream = dev.stream.cu_stream();
        let n = to_usize(len, "fill larger than the address space")?;
        if pattern.iter().all(|&b| b == pattern[0]) {
            // SAFETY: `at .. + len` is inside the read-write mapping (checked by `range`).
            check("cuMemsetD8Async", unsafe {
                sys::cuMemsetD8Async(at, pattern[0], n, stream)
            })?;
            return dev.sync();
        }
        let first = n.min(pattern.len());
        // SAFETY: `first` bytes of `pattern` to the start of the range (inside the mapping);
        // the copy is synchronous, so `pattern` outlives it.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(at, pattern.as_ptr().cast::<c_void>(), first)
        })?;
        for c in plan::fill_copies(len) {
            let n = to_usize(c.len, "fill larger than the address space")?;
            // SAFETY: `fill_copies` keeps every copy inside `0..len` of the range and never
            // overlapping its own source; copies run in stream order.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(at + c.to, at + c.from, n, stream)
            })?;
        }
        dev.sync()
    }

    fn read(&self, offset: PoolOffset, dst: &mut [u8]) -> Result<(), CudaError> {
        let at = self.range(offset, dst.len() as u64)?;
        self.map.dev.bind()?;
        self.map.dev.sync()?;
        // SAFETY: `at .. + dst.len()` is inside the mapping; the copy is synchronous and
        // writes only `dst`.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), at, dst.len())
        })
    }

    fn write(&self, offset: PoolOffset, src: &[u8]) -> Result<(), CudaError> {
        let at = self.range(offset, src.len() as u64)?;
        self.map.dev.bind()?;
        self.map.dev.sync()?;
        // SAFETY: `at .. + src.len()` is inside the read-write mapping; the copy is
        // synchronous and reads only `src`.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(at, src.as_ptr().cast::<c_void>(), src.len())
        })
    }

    fn export_fd(&self) -> BorrowedFd<'_> {
        self.export.as_fd()
    }

    fn dmabuf_fd(&self) -> Result<OwnedFd, CudaError> {
        if !self.map.dev.info.dmabuf {
            return Err(CudaError::Unsupported {
                ordinal: self.ordinal(),
                what: "dmabuf export (GPUDirect RDMA registration)",
            });
        }
        self.map.dev.bind()?;
        let mut fd: c_int = -1;
        // SAFETY: for a dmabuf handle type the driver writes one int through the pointer;
        // the range is the whole live mapping, from its allocation base (flags must be 0).
        check("cuMemGetHandleForAddressRange", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&raw mut fd).cast::<c_void>(),
                self.map.va,
                self.map.size,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError::OutOfRange {
                what: "the driver exported no dmabuf fd",
            });
        }
        // SAFETY: the driver just created `fd` for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// Another process's device pool, mapped read-only on this process's device: the source
/// of a pull.
pub struct CudaForeignPool {
    map: Mapping,
    page_bytes: u64,
    pages: u32,
}

impl fmt::Debug for CudaForeignPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaForeignPool")
            .field("device", &self.map.dev.ordinal())
            .field("pages", &self.pages)
            .field("page_bytes", &self.page_bytes)
            .finish_non_exhaustive()
    }
}

impl CudaForeignPool {
    /// Imports the pool exported as `fd` ([`DeviceMemory::export_fd`] of the owner) and maps
    /// its first `pages * page_bytes` bytes on `dev`, readable only.
    pub fn import(
        dev: &Arc<CudaDevice>,
        fd: BorrowedFd<'_>,
        page_bytes: u64,
        pages: u32,
    ) -> Result<CudaForeignPool, CudaError> {
        let len = page_bytes
            .checked_mul(u64::from(pages))
            .filter(|&l| l > 0)
            .ok_or(CudaError::OutOfRange {
                what: "foreign pool size is zero or overflows",
            })?;
        let raw = usize::try_from(fd.as_raw_fd()).map_err(|_| CudaError::OutOfRange {
            what: "a negative fd",
        })?;
        dev.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for a POSIX fd the OS handle is the fd's number passed as a pointer-sized
        // value; the driver dups what it needs and does not take ownership of `fd`.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                std::ptr::without_provenance_mut::<c_void>(raw),
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        // The granularity of the owner's allocation (its device may not be this one).
        let mut prop = allocation_prop(dev.ordinal(), false)?;
        // SAFETY: `prop` is valid for the driver to overwrite; `handle` is live.
        let got = check("cuMemGetAllocationPropertiesFromHandle", unsafe {
            sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle)
        });
        let size = got
            .and_then(|()| granularity(&prop))
            .and_then(|g| {
                len.checked_next_multiple_of(g)
                    .ok_or(CudaError::OutOfRange {
                        what: "foreign pool size overflows",
                    })
            })
            .and_then(|s| to_usize(s, "foreign pool larger than the address space"));
        let size = match size {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: the handle was imported above and is released once, here.
                let _ = unsafe { sys::cuMemRelease(handle) };
                return Err(e);
            }
        };
        let map = Mapping::map(
            dev,
            handle,
            size,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        )?;
        Ok(CudaForeignPool {
            map,
            page_bytes,
            pages,
        })
    }

    /// Pages in the foreign pool.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// The access this process's device has to the mapping (`cuMemGetAccess`): read-only
    /// (`CU_MEM_ACCESS_FLAGS_PROT_READ`, 1) when imported by [`import`](Self::import).
    pub fn access_flags(&self) -> Result<u64, CudaError> {
        let id = c_int::try_from(self.map.dev.ordinal()).map_err(|_| CudaError::OutOfRange {
            what: "device ordinal",
        })?;
        let loc = device_location(id);
        let mut flags: u64 = 0;
        // SAFETY: `flags` and `loc` are valid for the call; `va` is inside the live mapping.
        check("cuMemGetAccess", unsafe {
            sys::cuMemGetAccess(&mut flags, &loc, self.map.va)
        })?;
        Ok(flags)
    }

    /// Pulls foreign `pages`, in order, into `landing` (one landing page per foreign page):
    /// the copies [`plan::copy_runs`] plans, on the device's copy engine, then the digest
    /// kernel over the landed pages, whose digests verification compares with the manifest.
    /// Refuses a wrong count, a page out of range, a page size that differs and a landing on
    /// another device before copying anything.
    pub fn pull(&self, pages: &[PageId], landing: DeviceLanding<'_>) -> Result<(), CudaError> {
        if landing.page_bytes() != self.page_bytes {
            return Err(CudaError::Pull(PullError::PageSize {
                index: 0,
                page_bytes: self.page_bytes,
            }));
        }
        let dst = landing.memory();
        if dst.ordinal() != self.map.dev.ordinal() {
            return Err(CudaError::OutOfRange {
                what: "the landing pool is on another device than the mapping",
            });
        }
        let runs = plan::copy_runs(pages, self.pages, landing.offsets(), self.page_bytes)
            .map_err(CudaError::Pull)?;
        let dst_len = dst.len();
        let dst_base = dst.device_addr();
        let dev = &self.map.dev;
        dev.bind()?;
        let stream = dev.stream.cu_stream();
        for r in &runs {
            if r.dst.0.checked_add(r.len).is_none_or(|end| end > dst_len) {
                return Err(CudaError::OutOfRange {
                    what: "a landing page is outside the device pool",
                });
            }
            let n = to_usize(r.len, "copy larger than the address space")?;
            // SAFETY: the source run is inside the foreign mapping (pages < self.pages, and
            // the mapping covers pages * page_bytes); the destination run is inside the
            // landing pool (checked above), on pages the landing's grant alone may write.
            // The mapping and the landing both outlive the synchronization below.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst_base + r.dst.0, self.map.va + r.src.0, n, stream)
            })?;
        }
        dev.sync()?;
        landing.digest_landed()
    }

    /// One plain `cuMemcpyDtoD` of `len` bytes from the start of the foreign pool to the
    /// start of `dst`: the baseline the pull benchmark compares with.
    pub fn copy_plain(&self, dst: &dyn DeviceMemory, len: u64) -> Result<(), CudaError> {
        let foreign = u64::from(self.pages) * self.page_bytes;
        if len > foreign || len > PoolMemory::len(dst) {
            return Err(CudaError::OutOfRange {
                what: "copy longer than either pool",
            });
        }
        let n = to_usize(len, "copy larger than the address space")?;
        self.map.dev.bind()?;
        // SAFETY: `len` bytes from the start of both mappings, inside each (checked above);
        // synchronized before returning.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                dst.device_addr(),
                self.map.va,
                n,
                self.map.dev.stream.cu_stream(),
            )
        })?;
        self.map.dev.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_without_a_driver_is_refused_by_library_name() {
        if driver_present() {
            eprintln!("SKIPPED: this host has a CUDA driver");
            return;
        }
        let err = probe(0).unwrap_err();
        assert!(matches!(err, CudaError::NoDriver), "{err:?}");
        assert!(err.is_unavailable());
        assert!(err.to_string().contains("libcuda.so.1"), "{err}");
        let err = CudaDevice::open(0).unwrap_err();
        assert!(matches!(err, CudaError::NoDriver), "{err:?}");
    }

    #[test]
    fn the_kernel_carries_the_host_tables() {
        let src = digest_kernel_source();
        assert!(src.contains(DIGEST_KERNEL));
        assert!(src.contains(&format!("#define THREADS {}", plan::DIGEST_THREADS)));
        for v in plan::x2n_table() {
            assert!(src.contains(&format!("{v:#010x}u")), "{v:#x}");
        }
    }
}
