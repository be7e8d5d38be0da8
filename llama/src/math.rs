//! The numeric kernels of the runner: matrix products, normalization, rotary embedding,
//! softmax, the conversions between f32 and the page dtypes, and the threads that share a
//! decode step.
//!
//! # Determinism
//!
//! Every kernel here gives a result that depends only on its inputs, never on the number of
//! threads: work is split over independent outputs (rows of a product, attention heads), and
//! each output is computed by one thread with the same code in a fixed order. No reduction is
//! ever split.
//!
//! The decode's matrix-vector products run a kernel compiled for AVX2 and FMA when the CPU
//! has them (detected at run time), the portable one otherwise; the weight products of a
//! decode step are [`crate::quant::matvec_multi`]'s, which sum each row exactly as
//! [`dot_row`] does. The two round differently
//! (FMA rounds once per multiply-add), so a result depends on the CPU; both sides of a
//! comparison (monolithic and disaggregated) run on one machine and agree bit for bit. The
//! batched products go through `matrixmultiply`'s sgemm, which also picks its kernel by CPU.
//!
//! # Threads
//!
//! Starting a thread costs about 100 µs on a small virtual machine, as much as a whole
//! 576 x 576 product, so a decode step starts its threads once ([`team`]) and they run the
//! whole forward pass together: each takes runs of the rows of every product (and requests
//! of attention) one at a time, as it gets to them ([`Member::units`]), publishes them in
//! a [`SharedVec`], and all meet at a [`SpinBarrier`] before reading the full vector. So a
//! member whose core is shared with another process holds up the step by a run at most,
//! not by half of every product. The cheap vector work (norms, RoPE, residuals) is repeated by every thread on
//! identical inputs. The prefill's sgemm products are large enough to start threads per
//! product ([`for_each_parallel`]).
//!
//! # Layouts
//!
//! Matrices are row-major `[out][in]`. The batched (prefill) path keeps activations
//! *feature-major*, `[feature][token]`: `Y = W X` is then one sgemm whose output rows are the
//! rows of `W`, so threads split `W` and `Y` into contiguous row blocks.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};
use libkv::Dtype;

// ---------------------------------------------------------------------------------------------
// Threads

/// Runs `f` on each item, the items split into at most `threads` contiguous groups, one
/// thread per group (the calling thread takes the first). Which thread runs an item never
/// changes what it computes.
pub(crate) fn for_each_parallel<T: Send>(items: Vec<T>, threads: usize, f: impl Fn(T) + Sync) {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        items.into_iter().for_each(f);
        return;
    }
    let per = items.len().div_ceil(threads);
    let mut groups: Vec<Vec<T>> = Vec::with_capacity(threads);
    let mut it = items.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per).collect());
    }
    let f = &f;
    std::thread::scope(|s| {
        let mut groups = groups.into_iter();
        let first = groups.next();
        for g in groups {
            s.spawn(move || g.into_iter().for_each(f));
        }
        if let Some(g) = first {
            g.into_iter().for_each(f);
        }
    });
}

/// Spins before yielding the CPU while waiting at a barrier: the other threads of a team
/// are normally a few microseconds away.
const SPINS: u32 = 1 << 10;

/// A barrier for the threads of one [`team`], which wait by spinning (then yielding), far
/// cheaper than a futex wake-up when the threads have their own cores. Passing it orders
/// every store before it, by any member, before every load after it.
#[derive(Debug)]
pub(crate) struct SpinBarrier {
    n: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    /// Set when a member panicked: the others stop waiting (their results are then
    /// discarded, as the panic propagates from [`team`]).
    poisoned: AtomicBool,
    /// The next unit of the phase's work to hand out ([`Member::units`]), back to 0 at
    /// every barrier.
    next: AtomicUsize,
}

impl SpinBarrier {
    fn new(n: usize) -> SpinBarrier {
        SpinBarrier {
            n,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            next: AtomicUsize::new(0),
        }
    }

    fn wait(&self) {
        if self.n <= 1 {
            self.next.store(0, Ordering::Relaxed);
            return;
        }
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            // The last to arrive resets the count, then releases the others; none of them
            // arrives at the next barrier before it sees the new generation. Every member
            // took its last unit of this phase before arriving, so the next phase's units
            // start from 0.
            self.arrived.store(0, Ordering::Relaxed);
            self.next.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::AcqRel);
            return;
        }
        let mut spins = 0;
        while self.generation.load(Ordering::Acquire) == generation {
            if self.poisoned.load(Ordering::Relaxed) {
                return;
            }
            if spins < SPINS {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Poisons the barrier if its thread unwinds, so the other members do not wait forever.
struct PoisonOnPanic<'a>(&'a SpinBarrier);

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned.store(true, Ordering::Relaxed);
        }
    }
}

/// One thread of a [`team`].
#[derive(Debug)]
pub(crate) struct Member<'a> {
    index: usize,
    count: usize,
    barrier: &'a SpinBarrier,
    /// Whether this member took units in the current phase ([`Member::units`]).
    claimed: std::cell::Cell<bool>,
}

impl Member<'_> {
    /// This member's share of `0..n`: the `index`-th of `count` contiguous runs.
    pub(crate) fn share(&self, n: usize) -> Range<usize> {
        let per = n.div_ceil(self.count);
        let start = (self.index * per).min(n);
        start..(start + per).min(n)
    }

    /// Members in the team.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Units `0..n` of this phase's work (what the members do between two [`Self::sync`]s),
    /// as this member takes them, one at a time: the members together take each unit once,
    /// and one that runs ahead (its core not shared, its units short) takes more. Every
    /// member calls it at most once a phase, all with the same `n`.
    ///
    /// # Panics
    ///
    /// If this member already took units in this phase.
    pub(crate) fn units(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        assert!(
            !self.claimed.replace(true),
            "Member::units: once between two syncs"
        );
        std::iter::from_fn(move || {
            let i = self.barrier.next.fetch_add(1, Ordering::Relaxed);
            (i < n).then_some(i)
        })
    }

    /// Waits until every member got here.
    pub(crate) fn sync(&self) {
        self.claimed.set(false);
        self.barrier.wait();
    }

    /// Whether this is the calling thread (member 0).
    pub(crate) fn is_first(&self) -> bool {
        self.index == 0
    }
}

/// Runs `f` on `threads` threads at once (the calling thread is member 0), members meeting
/// at [`Member::sync`]; returns their results in member order. Every member must call `sync`
/// the same number of times.
pub(crate) fn team<R: Send>(threads: usize, f: impl Fn(&Member<'_>) -> R + Sync) -> Vec<R> {
    let count = threads.max(1);
    let barrier = SpinBarrier::new(count);
    let member = |index| Member {
        index,
        count,
        barrier: &barrier,
        claimed: std::cell::Cell::new(false),
    };
    if count == 1 {
        return vec![f(&member(0))];
    }
    let (f, member) = (&f, &member);
    std::thread::scope(|s| {
        let others: Vec<_> = (1..count)
            .map(|i| {
                s.spawn(move || {
                    let m = member(i);
                    let _guard = PoisonOnPanic(m.barrier);
                    f(&m)
                })
            })
            .collect();
        let first = {
            let m = member(0);
            let _guard = PoisonOnPanic(m.barrier);
            f(&m)
        };
        let mut out = vec![first];
        for h in others {
            match h.join() {
                Ok(r) => out.push(r),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        out
    })
}

/// A vector of f32 the members of a [`team`] share: each stores its share, and after a
/// [`Member::sync`] any member loads the whole. Relaxed atomics (plain moves on x86); the
/// barrier orders them.
#[derive(Debug)]
pub(crate) struct SharedVec(Vec<AtomicU32>);

impl SharedVec {
    pub(crate) fn new(len: usize) -> SharedVec {
        SharedVec((0..len).map(|_| AtomicU32::new(0)).collect())
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Stores `values` from index `at`.
    pub(crate) fn store(&self, at: usize, values: &[f32]) {
        for (a, v) in self.0[at..at + values.len()].iter().zip(values) {
            a.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    /// Loads `out.len()` values from index `at`.
    pub(crate) fn load(&self, at: usize, out: &mut [f32]) {
        for (o, a) in out.iter_mut().zip(&self.0[at..]) {
            *o = f32::from_bits(a.load(Ordering::Relaxed));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products and matrix-vector products (decode)

/// Lanes of one AVX register of f32.
const V: usize = 8;

/// `s` as whole arrays of [`V`] (a tail shorter than `V` is left out).
#[inline(always)]
fn lanes(s: &[f32]) -> impl Iterator<Item = &[f32; V]> {
    s.chunks_exact(V).filter_map(|c| c.try_into().ok())
}

/// `acc + a b`, fused when `FMA` (only where the CPU has FMA: otherwise `mul_add` is a slow
/// library call).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, acc: f32) -> f32 {
    if FMA { a.mul_add(b, acc) } else { acc + a * b }
}

/// `acc += a b`, lane by lane: one vector multiply-add.
#[inline(always)]
fn madd_lanes<const FMA: bool>(acc: &mut [f32; V], a: &[f32; V], b: &[f32; V]) {
    for i in 0..V {
        acc[i] = madd::<FMA>(a[i], b[i], acc[i]);
    }
}

/// The sum of the lanes, in a fixed tree.
#[inline(always)]
fn sum_lanes(a: &[f32; V]) -> f32 {
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (b[0] + b[2]) + (b[1] + b[3])
}

/// `a · b` over the shorter of the two with `K` vector accumulators (independent chains of
/// multiply-adds hide their latency), summed in a fixed tree. The result is a function of
/// `a` and `b` alone.
#[inline(always)]
fn dot_body<const FMA: bool, const K: usize>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [[0f32; V]; K];
    let blocks = n / (K * V) * (K * V);
    for (ab, bb) in a[..blocks]
        .chunks_exact(K * V)
        .zip(b[..blocks].chunks_exact(K * V))
    {
        for (acc, (x, y)) in acc.iter_mut().zip(lanes(ab).zip(lanes(bb))) {
            madd_lanes::<FMA>(acc, x, y);
        }
    }
    let whole = n / V * V;
    for (acc, (x, y)) in acc
        .iter_mut()
        .zip(lanes(&a[blocks..whole]).zip(lanes(&b[blocks..whole])))
    {
        madd_lanes::<FMA>(acc, x, y);
    }
    for (i, (x, y)) in a[whole..].iter().zip(&b[whole..]).enumerate() {
        acc[0][i] = madd::<FMA>(*x, *y, acc[0][i]);
    }
    let mut width = K / 2;
    while width > 0 {
        let (lo, hi) = acc.split_at_mut(width);
        for (l, h) in lo.iter_mut().zip(hi.iter()) {
            for (a, b) in l.iter_mut().zip(h) {
                *a += b;
            }
        }
        width /= 2;
    }
    sum_lanes(&acc[0])
}

/// Rows of at least this many columns use four vector accumulators; shorter ones
/// (attention's `head_dim`) one per row, four rows at a time.
const WIDE_ROWS: usize = 256;

/// One row of [`matvec`]'s product, `row · x`, summed exactly as `matvec` sums it (for
/// kernels that take rows one at a time: [`crate::quant::matvec_multi`]).
#[inline(always)]
pub(crate) fn dot_row<const FMA: bool>(row: &[f32], x: &[f32]) -> f32 {
    if x.len() >= WIDE_ROWS {
        dot_body::<FMA, 4>(row, x)
    } else {
        dot_body::<FMA, 1>(row, x)
    }
}

/// Four short rows at once, four independent chains. Each row is summed exactly as
/// `dot_body::<FMA, 1>` sums it, so results do not depend on how rows are grouped.
#[inline(always)]
fn dot4_body<const FMA: bool>(w4: &[f32], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    let whole = cols / V * V;
    let (r0, rest) = w4.split_at(cols);
    let (r1, rest) = rest.split_at(cols);
    let (r2, rest) = rest.split_at(cols);
    let r3 = &rest[..cols];
    let mut acc = [[0f32; V]; 4];
    let rows = lanes(&r0[..whole])
        .zip(lanes(&r1[..whole]))
        .zip(lanes(&r2[..whole]).zip(lanes(&r3[..whole])));
    for (((w0, w1), (w2, w3)), xv) in rows.zip(lanes(&x[..whole])) {
        madd_lanes::<FMA>(&mut acc[0], w0, xv);
        madd_lanes::<FMA>(&mut acc[1], w1, xv);
        madd_lanes::<FMA>(&mut acc[2], w2, xv);
        madd_lanes::<FMA>(&mut acc[3], w3, xv);
    }
    for (a, r) in acc.iter_mut().zip([r0, r1, r2, r3]) {
        for (i, (w, x)) in r[whole..].iter().zip(&x[whole..]).enumerate() {
            a[i] = madd::<FMA>(*w, *x, a[i]);
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = sum_lanes(a);
    }
}

#[inline(always)]
fn matvec_body<const FMA: bool>(w: &[f32], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    if cols >= WIDE_ROWS {
        for (o, row) in out.iter_mut().zip(w.chunks_exact(cols)) {
            *o = dot_body::<FMA, 4>(row, x);
        }
        return;
    }
    let fours = out.len() / 4 * 4;
    let (o4, o1) = out.split_at_mut(fours);
    for (o, w4) in o4.chunks_exact_mut(4).zip(w.chunks_exact(4 * cols)) {
        dot4_body::<FMA>(w4, x, o);
    }
    for (o, row) in o1.iter_mut().zip(w[fours * cols..].chunks_exact(cols)) {
        *o = dot_body::<FMA, 1>(row, x);
    }
}

/// `out += sum_s p[s] v[s]` for `v` row-major `[p.len()][out.len()]`: each output summed
/// over `s` in order, a block of outputs held in registers across all `s`.
#[inline(always)]
fn weighted_sum_body<const FMA: bool>(p: &[f32], v: &[f32], out: &mut [f32]) {
    const B: usize = 32;
    let n = out.len();
    let mut start = 0;
    while start < n {
        let width = B.min(n - start);
        let mut acc = [0f32; B];
        acc[..width].copy_from_slice(&out[start..start + width]);
        if width == B {
            for (&ps, row) in p.iter().zip(v.chunks_exact(n)) {
                let r = &row[start..start + B];
                for i in 0..B {
                    acc[i] = madd::<FMA>(ps, r[i], acc[i]);
                }
            }
        } else {
            for (&ps, row) in p.iter().zip(v.chunks_exact(n)) {
                for (a, &r) in acc.iter_mut().zip(&row[start..start + width]) {
                    *a = madd::<FMA>(ps, r, *a);
                }
            }
        }
        out[start..start + width].copy_from_slice(&acc[..width]);
        start += width;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn matvec_avx2(w: &[f32], x: &[f32], out: &mut [f32]) {
    matvec_body::<true>(w, x, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn weighted_sum_avx2(p: &[f32], v: &[f32], out: &mut [f32]) {
    weighted_sum_body::<true>(p, v, out);
}

/// Whether the AVX2+FMA kernels may run on this CPU.
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out = W x` for `W` row-major `[out.len()][x.len()]`, on the calling thread.
///
/// # Panics
///
/// If `w` is shorter than `out.len() * x.len()` (a bug in the caller: shapes are validated
/// when the runner is built).
pub(crate) fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    assert!(w.len() >= out.len() * x.len(), "matvec: matrix too small");
    if x.is_empty() {
        out.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above), the only
        // requirement of calling a function compiled with those features.
        unsafe { matvec_avx2(w, x, out) };
        return;
    }
    matvec_body::<false>(w, x, out);
}

/// `a · b` with the matrix-vector kernel.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut out = [0f32];
    matvec(a, &b[..a.len().min(b.len())], &mut out);
    out[0]
}

/// `out += sum_s p[s] v[s]` for `v` row-major `[p.len()][out.len()]` (attention's weighted
/// sum of V), each output summed over `s` in order.
///
/// # Panics
///
/// If `v` is shorter than `p.len() * out.len()` (a bug in the caller).
pub(crate) fn weighted_sum(p: &[f32], v: &[f32], out: &mut [f32]) {
    assert!(
        v.len() >= p.len() * out.len(),
        "weighted_sum: too few vectors"
    );
    if out.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above), the only
        // requirement of calling a function compiled with those features.
        unsafe { weighted_sum_avx2(p, v, out) };
        return;
    }
    weighted_sum_body::<false>(p, v, out);
}

// ---------------------------------------------------------------------------------------------
// Matrix products (prefill)

/// A strided view of a matrix inside a slice: element `(r, c)` is at `r * rs + c * cs`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View {
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl View {
    /// A row-major `rows x cols` matrix with rows `stride` apart.
    pub(crate) fn rows(rows: usize, cols: usize, stride: usize) -> View {
        View {
            rows,
            cols,
            rs: stride,
            cs: 1,
        }
    }

    /// The transpose of a row-major `cols x rows` matrix with rows `stride` apart: a
    /// `rows x cols` matrix whose columns are contiguous.
    pub(crate) fn cols(rows: usize, cols: usize, stride: usize) -> View {
        View {
            rows,
            cols,
            rs: 1,
            cs: stride,
        }
    }

    /// One past the largest index the view touches (0 when it is empty).
    fn extent(&self) -> Option<usize> {
        if self.rows == 0 || self.cols == 0 {
            return Some(0);
        }
        (self.rows - 1)
            .checked_mul(self.rs)?
            .checked_add((self.cols - 1).checked_mul(self.cs)?)?
            .checked_add(1)
    }

    /// Whether no two elements share an index (one stride is 1 and the other spans it).
    fn is_injective(&self) -> bool {
        self.rows <= 1
            || self.cols <= 1
            || (self.cs == 1 && self.rs >= self.cols)
            || (self.rs == 1 && self.cs >= self.rows)
    }

    fn strides(&self) -> Option<(isize, isize)> {
        Some((
            isize::try_from(self.rs).ok()?,
            isize::try_from(self.cs).ok()?,
        ))
    }
}

/// `C = alpha A B + beta C` through `matrixmultiply`'s sgemm.
///
/// # Panics
///
/// If a view reaches past its slice, the inner dimensions differ, or `C`'s elements alias
/// (bugs in the caller, which derives every view from validated shapes).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    alpha: f32,
    a: &[f32],
    va: View,
    b: &[f32],
    vb: View,
    beta: f32,
    c: &mut [f32],
    vc: View,
) {
    assert!(
        va.cols == vb.rows && va.rows == vc.rows && vb.cols == vc.cols,
        "sgemm: shapes {va:?} x {vb:?} -> {vc:?}"
    );
    let fits = |v: View, len: usize| v.extent().is_some_and(|e| e <= len);
    assert!(
        fits(va, a.len()) && fits(vb, b.len()) && fits(vc, c.len()),
        "sgemm: view past its slice"
    );
    assert!(vc.is_injective(), "sgemm: output elements alias");
    let (Some((rsa, csa)), Some((rsb, csb)), Some((rsc, csc))) =
        (va.strides(), vb.strides(), vc.strides())
    else {
        panic!("sgemm: stride overflow");
    };
    if vc.rows == 0 || vc.cols == 0 {
        return;
    }
    // SAFETY: every element sgemm reads, `a[r * rsa + k * csa]` for r < m, k < k and likewise
    // for `b`, lies inside its slice (`extent` checked above, without overflow), every element
    // it writes lies inside `c`, and no two elements of `c` alias (`is_injective`). `c` is
    // borrowed mutably, so it overlaps neither `a` nor `b`.
    unsafe {
        matrixmultiply::sgemm(
            va.rows,
            va.cols,
            vb.cols,
            alpha,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            rsc,
            csc,
        );
    }
}

/// `Y = W X + beta Y` in the feature-major layout: `W` is `[rows][cols]`, `X` is
/// `[cols][n]` and `Y` is `[rows][n]`, on the calling thread.
pub(crate) fn gemm_fm(w: &[f32], x: &[f32], n: usize, y: &mut [f32], beta: f32) {
    let rows = y.len() / n.max(1);
    let cols = x.len() / n.max(1);
    if rows == 0 || n == 0 {
        return;
    }
    sgemm(
        1.0,
        &w[..rows * cols],
        View::rows(rows, cols, cols),
        x,
        View::rows(cols, n, n),
        beta,
        y,
        View::rows(rows, n, n),
    );
}

/// [`gemm_fm`] of several matrices with one input, `Y_i = W_i X + beta Y_i`: the rows of all
/// of them, stacked, split over `threads` threads in runs of whole sgemm tiles. Each output
/// element is computed the same way whatever the split.
pub(crate) fn gemm_fm_stacked(
    jobs: Vec<(&[f32], &mut [f32])>,
    x: &[f32],
    n: usize,
    beta: f32,
    threads: usize,
) {
    let n = n.max(1);
    let cols = x.len() / n;
    let rows: usize = jobs.iter().map(|(_, y)| y.len() / n).sum();
    let threads = threads.max(1);
    // Runs of whole sgemm tiles (16 rows), so no thread gets a ragged sliver.
    let per = rows.div_ceil(threads).next_multiple_of(16).max(1);
    let mut runs: Vec<Vec<(&[f32], &mut [f32])>> = Vec::new();
    let mut room = 0;
    for (mut w, mut y) in jobs {
        while !y.is_empty() {
            if room == 0 {
                runs.push(Vec::new());
                room = per;
            }
            let take = room.min(y.len() / n);
            let (y_now, y_rest) = std::mem::take(&mut y).split_at_mut(take * n);
            let (w_now, w_rest) = w.split_at((take * cols).min(w.len()));
            if let Some(run) = runs.last_mut() {
                run.push((w_now, y_now));
            }
            (w, y) = (w_rest, y_rest);
            room -= take;
        }
    }
    for_each_parallel(runs, threads, |run| {
        for (w, y) in run {
            gemm_fm(w, x, n, y, beta);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Normalization, activation, rotary embedding, softmax

/// The RMSNorm scale `1 / sqrt(mean(x^2) + eps)`: the mean accumulated in f64, the scale
/// rounded to f32.
fn rms_scale(sum_sq: f64, n: usize, eps: f32) -> f32 {
    #[allow(clippy::cast_possible_truncation)]
    let s = (1.0 / (sum_sq / n.max(1) as f64 + f64::from(eps)).sqrt()) as f32;
    s
}

/// `out = x / sqrt(mean(x^2) + eps) * w`.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let s = rms_scale(ss, x.len(), eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = (v * s) * g;
    }
}

/// [`rms_norm`] of every token of a feature-major `[w.len()][n]` matrix.
pub(crate) fn rms_norm_fm(x: &[f32], w: &[f32], eps: f32, n: usize, out: &mut [f32]) {
    let mut ss = vec![0f64; n];
    for row in x.chunks_exact(n.max(1)) {
        for (s, &v) in ss.iter_mut().zip(row) {
            *s += f64::from(v) * f64::from(v);
        }
    }
    let scale: Vec<f32> = ss.iter().map(|&s| rms_scale(s, w.len(), eps)).collect();
    for ((orow, row), &g) in out
        .chunks_exact_mut(n.max(1))
        .zip(x.chunks_exact(n.max(1)))
        .zip(w)
    {
        for ((o, &v), &s) in orow.iter_mut().zip(row).zip(&scale) {
            *o = (v * s) * g;
        }
    }
}

/// `e^x` in f32, branch-free so that loops over it vectorize: `x = n ln2 + r` with `|r| <=
/// ln2 / 2` (ln2 split in two for an exact `r`), `e^r` by Cephes' polynomial,
/// times `2^n` built in the exponent bits. Within 2 ulp of the exact value; 0 below the
/// normal range, infinity above it, NaN for NaN. Plain multiplies and adds only, so it
/// rounds the same whatever the vector width the compiler picks.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer (ties to even) below 2^22.
    const ROUND: f32 = 12_582_912.0;
    let t = x.clamp(-87.0, 88.5);
    // k = n + ROUND exactly, so n is also in k's low mantissa bits.
    let k = t * LOG2E + ROUND;
    let n = k - ROUND;
    let r = (t - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = (p * r) * r + r + 1.0;
    // n is an integer in [-126, 128]; 2^n as 2^h 2^(n - h), h = n / 2, keeps both exponents
    // in the normal range (scaling by a power of two is exact).
    #[allow(clippy::cast_possible_wrap)]
    let n = k.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let h = n >> 1;
    #[allow(clippy::cast_sign_loss)]
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let e = y * pow2(h) * pow2(n - h);
    let e = if x < -87.0 { 0.0 } else { e };
    if x > 88.5 { f32::INFINITY } else { e }
}

#[inline(always)]
fn silu_mul_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp_f32(-*g)) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
    silu_mul_body(gate, up);
}

/// `gate = silu(gate) * up`, with `silu(x) = x / (1 + e^-x)`.
pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above), the only
        // requirement of calling a function compiled with those features. The result is
        // the same as the portable code's (no fused multiply-add in it).
        unsafe { silu_mul_avx2(gate, up) };
        return;
    }
    silu_mul_body(gate, up);
}

/// The rotary frequencies `base^(-2i / head_dim)` for `i < head_dim / 2`, in f64.
pub(crate) fn rope_freqs(base: f32, head_dim: usize) -> Vec<f64> {
    let hd = head_dim as f64;
    (0..head_dim / 2)
        .map(|i| f64::from(base).powf(-2.0 * i as f64 / hd))
        .collect()
}

/// `cos` and `sin` of the rotary angles `pos * freq`, computed in f64 and rounded to f32.
pub(crate) fn rope_angles(freqs: &[f64], pos: u64, cos: &mut [f32], sin: &mut [f32]) {
    for ((&f, c), s) in freqs.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
        let a = pos as f64 * f;
        #[allow(clippy::cast_possible_truncation)]
        {
            *c = a.cos() as f32;
            *s = a.sin() as f32;
        }
    }
}

/// Rotate-half RoPE of one head in place: `(x[i], x[i + hd/2])` turns by angle `i`.
pub(crate) fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (a, b) = x.split_at_mut(half);
    for (((a, b), &c), &s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
        let (x0, x1) = (*a, *b);
        *a = x0 * c - x1 * s;
        *b = x1 * c + x0 * s;
    }
}

/// [`rope_head`] of every token of one head in a feature-major `[head_dim][n]` block, with
/// angle tables `[head_dim / 2][n]`.
pub(crate) fn rope_head_fm(x: &mut [f32], n: usize, cos: &[f32], sin: &[f32]) {
    let half = cos.len() / n.max(1);
    let (a, b) = x.split_at_mut(half * n);
    for (((a, b), c), s) in a
        .chunks_exact_mut(n)
        .zip(b.chunks_exact_mut(n))
        .zip(cos.chunks_exact(n))
        .zip(sin.chunks_exact(n))
    {
        for (((a, b), &c), &s) in a.iter_mut().zip(b.iter_mut()).zip(c).zip(s) {
            let (x0, x1) = (*a, *b);
            *a = x0 * c - x1 * s;
            *b = x1 * c + x0 * s;
        }
    }
}

/// Softmax in place, `e^(x - max) / sum`, the max and the sum taken over [`V`] lanes (so that
/// they vectorize) and combined in a fixed tree. A NaN makes every output NaN.
#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    let whole = x.len() / V * V;
    let mut m = [f32::NEG_INFINITY; V];
    for c in lanes(&x[..whole]) {
        for i in 0..V {
            m[i] = m[i].max(c[i]);
        }
    }
    for (i, &v) in x[whole..].iter().enumerate() {
        m[i] = m[i].max(v);
    }
    let max = (m[0].max(m[4]).max(m[2].max(m[6]))).max(m[1].max(m[5]).max(m[3].max(m[7])));
    let mut sum = [0f32; V];
    for c in x[..whole].chunks_exact_mut(V) {
        for (s, v) in sum.iter_mut().zip(c) {
            *v = exp_f32(*v - max);
            *s += *v;
        }
    }
    for (s, v) in sum.iter_mut().zip(&mut x[whole..]) {
        *v = exp_f32(*v - max);
        *s += *v;
    }
    let inv = 1.0 / sum_lanes(&sum);
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_avx2(x: &mut [f32]) {
    softmax_body(x);
}

/// Softmax in place: `e^(x - max) / sum`, in f32.
pub(crate) fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time just above), the only
        // requirement of calling a function compiled with those features. The result is
        // the same as the portable code's (no fused multiply-add in it).
        unsafe { softmax_avx2(x) };
        return;
    }
    softmax_body(x);
}

/// The index of the largest value, the lowest index on ties; NaNs are skipped. `None` when
/// every value is NaN (or there are none).
pub(crate) fn argmax(x: &[f32]) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { argmax_avx2(x) };
    }
    argmax_body(x)
}

/// [`argmax`], one value at a time.
fn argmax_body(x: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// [`argmax`] in two passes of eight values: the largest value that is not NaN (max is
/// exact in any order), then the first index holding a value equal to it, which is the
/// first of the largest (a zero of either sign equals the other, as `>` finds it).
///
/// # Safety
///
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmax_avx2(x: &[f32]) -> Option<usize> {
    use std::arch::x86_64::*;
    let whole = x.len() / 8 * 8;
    let p = x.as_ptr();
    // SAFETY: every load reads values `i..i + 8` below `whole`; AVX2 is the caller's
    // promise.
    let max = unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for i in (0..whole).step_by(8) {
            let v = _mm256_loadu_ps(p.add(i));
            // NaN lanes count as -inf.
            let ordered = _mm256_cmp_ps::<_CMP_ORD_Q>(v, v);
            m = _mm256_max_ps(
                m,
                _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), v, ordered),
            );
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        lanes
            .into_iter()
            .chain(x[whole..].iter().copied().filter(|v| !v.is_nan()))
            .fold(f32::NEG_INFINITY, f32::max)
    };
    // SAFETY: as above.
    unsafe {
        let want = _mm256_set1_ps(max);
        for i in (0..whole).step_by(8) {
            let hits =
                _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(p.add(i)), want));
            if hits != 0 {
                return Some(i + hits.trailing_zeros() as usize);
            }
        }
    }
    x[whole..].iter().position(|&v| v == max).map(|i| whole + i)
}

// ---------------------------------------------------------------------------------------------
// Page dtypes

/// Rounds `x` in place to the nearest value of `dtype` (round to nearest even), exactly the
/// value [`encode`] stores and [`decode`] reads back.
pub(crate) fn round_to(dtype: Dtype, x: &mut [f32]) {
    match dtype {
        Dtype::F32 => {}
        Dtype::Bf16 => x.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
        Dtype::F16 => {
            let mut h = [f16::ZERO; 64];
            for c in x.chunks_mut(64) {
                let h = &mut h[..c.len()];
                h.convert_from_f32_slice(c);
                h.convert_to_f32_slice(c);
            }
        }
    }
}

/// Stores `src` little-endian in `dtype` at the start of `out`, which must hold
/// `src.len() * dtype.size()` bytes.
pub(crate) fn encode(dtype: Dtype, src: &[f32], out: &mut [u8]) {
    match dtype {
        Dtype::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(src) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        Dtype::F16 => {
            let mut h = [f16::ZERO; 64];
            for (c, o) in src.chunks(64).zip(out.chunks_mut(128)) {
                let h = &mut h[..c.len()];
                h.convert_from_f32_slice(c);
                for (o, v) in o.chunks_exact_mut(2).zip(h.iter()) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

/// Asks the cache for every line of `bytes` ahead of reading them (a hint: no effect on
/// any result, nothing where the CPU has no such instruction).
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: SSE is part of x86_64; a prefetch reads nothing and never faults, and
        // its address is inside `bytes`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// bf16 to f32: the 16 bits become the high half of the f32, exactly.
#[inline(always)]
fn bf16_body(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
    }
}

/// [`bf16_body`], eight values at a time.
///
/// # Safety
///
/// The CPU has AVX2; `bytes` holds at least `2 * out.len()` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn bf16_avx2(bytes: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let whole = out.len() / 8 * 8;
    let (src, dst) = (bytes.as_ptr(), out.as_mut_ptr());
    for i in (0..whole).step_by(8) {
        // SAFETY: values `i..i + 8` are inside both slices (the caller's promise).
        unsafe {
            let h = _mm_loadu_si128(src.add(2 * i).cast());
            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
            _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(w));
        }
    }
    bf16_body(&bytes[2 * whole..], &mut out[whole..]);
}

/// Reads `out.len()` elements of `dtype` from the start of `bytes`.
pub(crate) fn decode(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        Dtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::Bf16 => {
            assert!(bytes.len() >= 2 * out.len(), "decode: too few bytes");
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above); `bytes` holds `out`'s
                // values (asserted).
                unsafe { bf16_avx2(bytes, out) };
                return;
            }
            bf16_body(bytes, out);
        }
        Dtype::F16 => {
            let mut bits = [0u16; 64];
            for (o, b) in out.chunks_mut(64).zip(bytes.chunks(128)) {
                let bits = &mut bits[..o.len()];
                for (u, b) in bits.iter_mut().zip(b.chunks_exact(2)) {
                    *u = u16::from_le_bytes([b[0], b[1]]);
                }
                bits.reinterpret_cast::<f16>().convert_to_f32_slice(o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        #[allow(clippy::cast_possible_truncation)]
        let v = ((*seed >> 40) as f32) / (1u64 << 24) as f32;
        v * 2.0 - 1.0
    }

    #[test]
    fn matvec_matches_a_plain_loop() {
        let mut s = 7;
        for (rows, cols) in [(1, 1), (3, 7), (5, 32), (9, 33), (17, 100)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
            let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s)).collect();
            let mut out = vec![0f32; rows];
            matvec(&w, &x, &mut out);
            for r in 0..rows {
                let want: f64 = (0..cols)
                    .map(|c| f64::from(w[r * cols + c]) * f64::from(x[c]))
                    .sum();
                assert!(
                    (f64::from(out[r]) - want).abs() < 1e-4,
                    "{rows}x{cols} row {r}"
                );
            }
        }
    }

    use crate::quant::{Inputs, Mat, matvec_multi, matvec_multi_stacked};

    /// `[W1; W2] x` by a team of `threads`, each member its share of the rows.
    fn team_matvec(w1: &[f32], w2: &[f32], x: &[f32], threads: usize) -> Vec<f32> {
        let rows = (w1.len() + w2.len()) / x.len();
        let out = SharedVec::new(rows);
        team(threads, |m| {
            let r = m.share(rows);
            let mut part = vec![0f32; r.len()];
            let cols = x.len();
            let ms = [Mat::F32 { w: w1, cols }, Mat::F32 { w: w2, cols }];
            matvec_multi_stacked(&ms, &Inputs::new(vec![x]), r.clone(), &mut part);
            out.store(r.start, &part);
            m.sync();
        });
        let mut all = vec![0f32; rows];
        out.load(0, &mut all);
        all
    }

    #[test]
    fn team_matvec_does_not_depend_on_threads() {
        let mut s = 11;
        let (cols, r1, r2) = (300, 250, 77);
        let w1: Vec<f32> = (0..r1 * cols).map(|_| lcg(&mut s)).collect();
        let w2: Vec<f32> = (0..r2 * cols).map(|_| lcg(&mut s)).collect();
        let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s)).collect();
        let one = team_matvec(&w1, &w2, &x, 1);
        let (mut o1, mut o2) = (vec![0f32; r1], vec![0f32; r2]);
        matvec(&w1, &x, &mut o1);
        matvec(&w2, &x, &mut o2);
        o1.extend(o2);
        assert_eq!(one, o1);
        for t in [2, 3, 5] {
            assert_eq!(team_matvec(&w1, &w2, &x, t), one, "threads {t}");
        }
    }

    #[test]
    fn team_members_meet_at_each_sync() {
        let counter = AtomicUsize::new(0);
        let seen = team(4, |m| {
            let mut seen = Vec::new();
            for round in 1..=50 {
                counter.fetch_add(1, Ordering::Relaxed);
                m.sync();
                seen.push(counter.load(Ordering::Relaxed) == round * 4);
                m.sync();
            }
            seen
        });
        assert_eq!(seen.len(), 4);
        assert!(seen.iter().flatten().all(|&ok| ok));
    }

    /// In every phase the members take each unit once between them, whatever the count of
    /// units (none, fewer than members, many), and the next phase starts from unit 0. One
    /// member is slowed down, so the others take more of its units.
    #[test]
    fn team_members_take_each_unit_once_a_phase() {
        let phases = [0usize, 1, 3, 4, 17, 200, 5];
        for threads in [1, 2, 3, 4] {
            let taken = team(threads, |m| {
                let mut taken = Vec::new();
                for &n in &phases {
                    let mine: Vec<usize> = m
                        .units(n)
                        .inspect(|_| {
                            if m.is_first() {
                                std::thread::sleep(std::time::Duration::from_micros(50));
                            }
                        })
                        .collect();
                    taken.push(mine);
                    m.sync();
                }
                taken
            });
            for (p, &n) in phases.iter().enumerate() {
                let mut all: Vec<usize> = taken.iter().flat_map(|t| t[p].clone()).collect();
                all.sort_unstable();
                assert_eq!(
                    all,
                    (0..n).collect::<Vec<_>>(),
                    "{threads} threads, phase {p}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "once between two syncs")]
    fn a_member_takes_units_once_a_phase() {
        team(1, |m| {
            m.units(3).for_each(drop);
            m.units(3).for_each(drop);
        });
    }

    #[test]
    fn gemm_matches_matvec_and_does_not_depend_on_threads() {
        let mut s = 3;
        let (rows, cols, n) = (70, 45, 9);
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
        let x: Vec<f32> = (0..cols * n).map(|_| lcg(&mut s)).collect();
        let run = |t| {
            let mut y = vec![0f32; rows * n];
            let (a, b) = y.split_at_mut(23 * n);
            gemm_fm_stacked(vec![(&w[..], a), (&w[23 * cols..], b)], &x, n, 0.0, t);
            y
        };
        let y = run(1);
        for t in [2, 3, 4] {
            assert_eq!(run(t), y, "threads {t}");
        }
        for j in 0..n {
            let col: Vec<f32> = (0..cols).map(|c| x[c * n + j]).collect();
            let mut o = vec![0f32; rows];
            matvec(&w, &col, &mut o);
            for r in 0..rows {
                assert!((o[r] - y[r * n + j]).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn dtype_round_trip_is_the_rounding() {
        let mut s = 5;
        let x: Vec<f32> = (0..200).map(|_| lcg(&mut s) * 100.0).collect();
        for dt in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            let mut r = x.clone();
            round_to(dt, &mut r);
            let mut bytes = vec![0u8; x.len() * dt.size()];
            encode(dt, &x, &mut bytes);
            let mut back = vec![0f32; x.len()];
            decode(dt, &bytes, &mut back);
            assert_eq!(r, back);
            // Lengths off the vector width end in the scalar tail.
            for n in [197, 5] {
                let mut part = vec![0f32; n];
                decode(dt, &bytes, &mut part);
                assert_eq!(part, back[..n]);
            }
            for (i, v) in x.iter().enumerate() {
                assert_eq!(dt.decode(&bytes[i * dt.size()..]), back[i]);
                let mut one = [0u8; 4];
                dt.encode(*v, &mut one);
                assert_eq!(
                    &one[..dt.size()],
                    &bytes[i * dt.size()..(i + 1) * dt.size()]
                );
            }
        }
    }

    #[test]
    fn matvec_rows_do_not_depend_on_their_grouping() {
        let mut s = 13;
        for cols in [5, 64, 300] {
            let rows = 11;
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
            let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s)).collect();
            let mut all = vec![0f32; rows];
            matvec(&w, &x, &mut all);
            for r in 0..rows {
                let mut one = [0f32];
                matvec(&w[r * cols..], &x, &mut one);
                assert_eq!(one[0], all[r], "cols {cols} row {r}");
                let mut from = vec![0f32; rows - r];
                matvec_multi(Mat::F32 { w: &w, cols }, &[&x], r..rows, &mut from);
                assert_eq!(from, all[r..], "cols {cols} rows {r}..");
            }
        }
    }

    #[test]
    fn weighted_sum_matches_a_plain_loop() {
        let mut s = 17;
        for n in [3, 32, 64, 70] {
            let slots = 9;
            let p: Vec<f32> = (0..slots).map(|_| lcg(&mut s)).collect();
            let v: Vec<f32> = (0..slots * n).map(|_| lcg(&mut s)).collect();
            let mut out: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let mut want: Vec<f64> = out.iter().map(|&o| f64::from(o)).collect();
            for (j, &pj) in p.iter().enumerate() {
                for d in 0..n {
                    want[d] += f64::from(pj) * f64::from(v[j * n + d]);
                }
            }
            weighted_sum(&p, &v, &mut out);
            for d in 0..n {
                assert!((f64::from(out[d]) - want[d]).abs() < 1e-5, "n {n} dim {d}");
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.5 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_f32(x));
            worst = worst.max((got - want).abs() / want);
            x += 0.000_37;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_sums_to_one_and_spreads_nan() {
        let mut s = 23;
        for n in [1, 7, 8, 9, 100] {
            let mut x: Vec<f32> = (0..n).map(|_| lcg(&mut s) * 30.0).collect();
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want: Vec<f64> = x.iter().map(|&v| f64::from(v - max).exp()).collect();
            let total: f64 = want.iter().sum();
            softmax(&mut x);
            for (g, w) in x.iter().zip(&want) {
                assert!((f64::from(*g) - w / total).abs() < 1e-6);
            }
        }
        let mut x = [1.0, f32::NAN, 2.0];
        softmax(&mut x);
        assert!(x.iter().all(|v| v.is_nan()));
    }

    #[test]
    #[allow(clippy::cast_possible_truncation)] // small draws, to pick a case
    fn argmax_takes_the_lowest_index_on_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN]), Some(1));
        assert_eq!(argmax(&[f32::NAN]), None);
        assert_eq!(argmax(&[]), None);
        // Every length around the vector width, with ties, zeros of both signs, infinities
        // and NaNs: the same index as one value at a time.
        let mut seed = 3;
        for n in 0..40 {
            for _ in 0..20 {
                let x: Vec<f32> = (0..n)
                    .map(|_| match (lcg(&mut seed) * 8.0) as i32 {
                        -8..=-6 => f32::NAN,
                        -5 => -0.0,
                        -4 => 0.0,
                        -3 => f32::NEG_INFINITY,
                        -2 => 1.0,
                        _ => (lcg(&mut seed) * 4.0).round(),
                    })
                    .collect();
                assert_eq!(argmax(&x), argmax_body(&x), "{x:?}");
            }
        }
        assert_eq!(argmax(&[-0.0, 0.0]), Some(0));
        assert_eq!(argmax(&[f32::NAN; 9]), None);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 9]), Some(0));
    }

    #[test]
    fn rope_rotates_pairs() {
        let freqs = rope_freqs(10000.0, 4);
        let (mut c, mut s) = ([0f32; 2], [0f32; 2]);
        rope_angles(&freqs, 0, &mut c, &mut s);
        let mut x = [1.0, 2.0, 3.0, 4.0];
        rope_head(&mut x, &c, &s);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0]);
        rope_angles(&freqs, 1, &mut c, &mut s);
        rope_head(&mut x, &c, &s);
        let (c0, s0) = (1f32.cos(), 1f32.sin());
        assert!((x[0] - (1.0 * c0 - 3.0 * s0)).abs() < 1e-6);
        assert!((x[2] - (3.0 * c0 + 1.0 * s0)).abs() < 1e-6);
    }
}
