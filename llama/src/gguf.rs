//! A reader of GGUF model files (versions 2 and 3) and exact dequantization of their tensors.
//!
//! # Format
//!
//! Everything is little-endian. A file is a header, metadata key/value pairs, tensor infos,
//! padding, then the data section:
//!
//! ```text
//! header        magic "GGUF" (4 bytes), version: u32 (2 or 3),
//!               tensor_count: u64, kv_count: u64
//! kv_count x    key: string, value_type: u32, value
//! tensor_count x name: string, n_dims: u32 (1..=4), ne: n_dims x u64 (ne0 first),
//!               ggml_type: u32, offset: u64 (relative to the data section)
//! padding       up to a multiple of `general.alignment` (a u32 key; 32 when absent)
//! data section  tensor bytes, each tensor at its offset (a multiple of the alignment)
//!
//! string        len: u64, then len bytes of UTF-8 (no terminator)
//! value         by value_type: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool (one
//!               byte, 0 or 1), 8 string, 9 array, 10 u64, 11 i64, 12 f64
//! array         element_type: u32, count: u64, then count values of that type (arrays nest)
//! ```
//!
//! A tensor's shape is `ne0..ne{n_dims-1}`, `ne0` varying fastest: a 2-d weight matrix with
//! `ne = [in, out]` is `out` rows of `in` contiguous elements. Rows are stored in blocks of
//! the tensor's ggml type; the types dequantized here are:
//!
//! | type | id | block | bytes | element `j` of a block |
//! |------|----|-------|-------|------------------------|
//! | F32  | 0  | 1     | 4     | the f32 |
//! | F16  | 1  | 1     | 2     | the IEEE half, widened |
//! | Q4_0 | 2  | 32    | 18    | f16 `d`, 16 bytes `qs`: `(nibble - 8) * d` |
//! | Q4_1 | 3  | 32    | 20    | f16 `d`, f16 `m`, 16 bytes `qs`: `nibble * d + m` |
//! | Q8_0 | 8  | 32    | 34    | f16 `d`, 32 × i8 `qs`: `qs[j] * d` |
//! | BF16 | 30 | 1     | 2     | the bfloat16, widened (`bits << 16`) |
//!
//! In the 4-bit types, element `j < 16` is the low nibble of `qs[j]` and element `j + 16` its
//! high nibble. The arithmetic is that of ggml's reference `dequantize_row_*` (an f32
//! product, then an f32 sum for Q4_1), so the values are bit-identical to its scalar code.
//!
//! # Trust
//!
//! A model file is untrusted input: every count and length is bounded by the bytes that
//! remain in the file before anything is allocated for it, arrays nest at most
//! [`MAX_ARRAY_DEPTH`] deep, and every tensor is checked at open to lie inside the file, so
//! a truncated or corrupt file gives a [`GgufError`], never a panic or a huge allocation.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

/// The file name of the default model, SmolLM2-135M-Instruct quantized to Q4_1.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The first four bytes of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";

/// The data section's alignment when the file has no `general.alignment` key.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// How deep arrays of arrays may nest (an array of strings is depth 1).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// The most dimensions a tensor has.
pub const MAX_DIMS: usize = 4;

/// Where the default model lives: `$KVFENCE_MODEL` when set, else
/// `$XDG_CACHE_HOME/kvfence/models/SmolLM2-135M-Instruct.Q4_1.gguf`, `XDG_CACHE_HOME`
/// defaulting to `$HOME/.cache` (and to a relative `.cache` without `HOME`).
pub fn default_model_path() -> PathBuf {
    if let Some(path) = std::env::var_os("KVFENCE_MODEL").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    // The XDG spec says a relative XDG_CACHE_HOME is invalid and to be ignored.
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .unwrap_or_else(|| {
            std::env::var_os("HOME")
                .filter(|h| !h.is_empty())
                .map_or_else(PathBuf::new, PathBuf::from)
                .join(".cache")
        });
    cache
        .join("kvfence")
        .join("models")
        .join(DEFAULT_MODEL_FILE)
}

/// Why a GGUF file could not be read, or a key or tensor not taken from it.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot map {} into memory", path.display())]
    Map {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("file ends at byte {len} while reading {what} at byte {offset}")]
    Truncated {
        what: &'static str,
        offset: u64,
        len: u64,
    },

    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },

    #[error("GGUF version {0} is not supported (only 2 and 3; a big-endian file also lands here)")]
    UnsupportedVersion(u32),

    #[error(
        "{what} at byte {offset} is {count}, more than the {remaining} bytes left in the file can hold"
    )]
    CountTooLarge {
        what: &'static str,
        offset: u64,
        count: u64,
        remaining: u64,
    },

    #[error("unknown metadata value type {type_id} at byte {offset}")]
    BadValueType { type_id: u32, offset: u64 },

    #[error("bool at byte {offset} is {value}, not 0 or 1")]
    BadBool { value: u8, offset: u64 },

    #[error("string at byte {offset} is not UTF-8")]
    BadUtf8 { offset: u64 },

    #[error("arrays nest deeper than {MAX_ARRAY_DEPTH} at byte {offset}")]
    NestingTooDeep { offset: u64 },

    #[error("metadata key {0:?} appears twice")]
    DuplicateKey(String),

    #[error("tensor {0:?} appears twice")]
    DuplicateTensor(String),

    #[error("general.alignment is {0}; it must be a power of two")]
    BadAlignment(u64),

    #[error("tensor {name:?} has {n_dims} dimensions; 1 to {MAX_DIMS} are allowed")]
    BadDimCount { name: String, n_dims: u32 },

    #[error("tensor {name:?} has dims {dims:?}, whose element count overflows")]
    ShapeOverflow { name: String, dims: Vec<u64> },

    #[error(
        "tensor {name:?} of type {ggml_type}: ne0 = {ne0} is not a multiple of its block of {block}"
    )]
    PartialBlock {
        name: String,
        ggml_type: GgmlType,
        ne0: u64,
        block: usize,
    },

    #[error("tensor {name:?} at data offset {offset} is not aligned to {alignment}")]
    Misaligned {
        name: String,
        offset: u64,
        alignment: u64,
    },

    #[error("tensor {name:?} spans bytes {start}..{end}, past the file's end at {len}")]
    TensorOutOfBounds {
        name: String,
        start: u64,
        end: u64,
        len: u64,
    },

    #[error("metadata key {0:?} is missing")]
    MissingKey(String),

    #[error("metadata key {key:?} is {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    #[error("tensor {0:?} is missing")]
    MissingTensor(String),

    #[error("tensor {name:?} has type {ggml_type}, which this reader does not dequantize")]
    UnsupportedType { name: String, ggml_type: GgmlType },

    #[error("cannot dequantize {0}")]
    CannotDequantize(GgmlType),

    #[error("{ggml_type} data of {bytes} bytes does not hold exactly {elements} elements")]
    BadDataLength {
        ggml_type: GgmlType,
        bytes: usize,
        elements: usize,
    },
}

/// The type of a metadata value, as its `u32` id in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type with id `id`, if there is one.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// The id the file stores for this type.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The type's name in error messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type takes in the file: what bounds an array's
    /// count by the bytes left.
    fn min_size(self) -> u64 {
        match self {
            Self::U8 | Self::I8 | Self::Bool => 1,
            Self::U16 | Self::I16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 | Self::String => 8,
            // element type u32 + count u64
            Self::Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// The element type (kept so that an empty array keeps it), then the elements, all of
    /// that type.
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::F32(_) => ValueType::F32,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array(..) => ValueType::Array,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value, widened to i128 (which holds every integer type's range).
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(v) => v.into(),
            Self::I8(v) => v.into(),
            Self::U16(v) => v.into(),
            Self::I16(v) => v.into(),
            Self::U32(v) => v.into(),
            Self::I32(v) => v.into(),
            Self::U64(v) => v.into(),
            Self::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a u32: any integer type whose value fits.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }

    /// The value as a u64: any integer type whose value fits.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// The value as an i32: any integer type whose value fits.
    pub fn as_i32(&self) -> Option<i32> {
        self.as_i128().and_then(|v| i32::try_from(v).ok())
    }

    /// The value as an f32: an f32, or an f64 rounded to the nearest f32.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Self::F32(v) => Some(v),
            #[allow(clippy::cast_possible_truncation)] // rounding to f32 is the point
            Self::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value's elements, if it is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Self::Array(_, items) => Some(items),
            _ => None,
        }
    }

    /// The type's description in error messages: `u32`, or `array of string`.
    fn describe(&self) -> String {
        match self {
            Self::Array(t, _) => format!("array of {}", t.name()),
            other => other.value_type().name().to_owned(),
        }
    }
}

/// A tensor's element type, as ggml numbers it. Only the types this reader dequantizes have
/// their own variant; the others keep their id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)] // ggml's names
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
    /// A type this reader does not dequantize (and cannot size), by its ggml id.
    Other(u32),
}

impl GgmlType {
    /// The type with ggml id `id`.
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            other => Self::Other(other),
        }
    }

    /// The ggml id of the type.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::BF16 => 30,
            Self::Other(id) => id,
        }
    }

    /// ggml's name for the type (`"Q4_K"`), or `None` for an id ggml does not define.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.id() {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return None,
        })
    }

    /// Elements per block, for the types this reader knows the layout of.
    pub fn block_size(self) -> Option<usize> {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => Some(1),
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => Some(32),
            Self::Other(_) => None,
        }
    }

    /// Bytes per block, for the types this reader knows the layout of.
    pub fn block_bytes(self) -> Option<usize> {
        match self {
            Self::F32 => Some(4),
            Self::F16 | Self::BF16 => Some(2),
            Self::Q4_0 => Some(18),
            Self::Q4_1 => Some(20),
            Self::Q8_0 => Some(34),
            Self::Other(_) => None,
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self, self.name()) {
            (Self::Other(id), Some(name)) => write!(f, "{name} (ggml type {id})"),
            (Self::Other(id), None) => write!(f, "unknown ggml type {id}"),
            (_, Some(name)) => f.write_str(name),
            (_, None) => write!(f, "ggml type {}", self.id()),
        }
    }
}

/// One tensor's description. Built only by the parser, which checked that its bytes (when
/// its type's layout is known) lie inside the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    name: String,
    ne: [u64; MAX_DIMS],
    n_dims: usize,
    ggml_type: GgmlType,
    offset: u64,
    n_elements: u64,
    /// Absolute byte range in the file; `None` for a type whose layout is unknown.
    span: Option<(usize, usize)>,
}

impl TensorInfo {
    /// The tensor's name, e.g. `blk.0.attn_q.weight`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The dimensions, `ne0` (contiguous) first; 1 to 4 of them.
    pub fn dims(&self) -> &[u64] {
        &self.ne[..self.n_dims]
    }

    /// The dimensions padded with 1 to four, as ggml's `ne[4]`.
    pub fn ne(&self) -> [u64; MAX_DIMS] {
        self.ne
    }

    /// The element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// The offset of the tensor's bytes from the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// How many elements the tensor has.
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }
}

/// An open GGUF file: its metadata and tensor infos parsed, its bytes mapped.
pub struct Gguf {
    map: Mmap,
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl fmt::Debug for Gguf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("bytes", &self.map.len())
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .field("keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl Gguf {
    /// Maps the file at `path` and parses its header, metadata and tensor infos.
    ///
    /// The file must not be modified or truncated while the returned value lives (it is
    /// mapped, not copied): model files are written once, then only read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| GgufError::Open {
            path: path.to_owned(),
            source,
        })?;
        let len = file
            .metadata()
            .map_err(|source| GgufError::Open {
                path: path.to_owned(),
                source,
            })?
            .len();
        // A mapping cannot be empty; a file shorter than the header is refused before it.
        if len < HEADER_BYTES {
            return Err(GgufError::Truncated {
                what: "header",
                offset: 0,
                len,
            });
        }
        // SAFETY: the mapping is read-only and private to this value, and all access to it
        // goes through bounds-checked slices. The remaining hazard of any file mapping, a
        // concurrent writer changing or truncating the file under it, is excluded by the
        // contract documented above: model files are not modified while they are open.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Map {
            path: path.to_owned(),
            source,
        })?;
        let parsed = parse(&map)?;
        Ok(Self {
            map,
            version: parsed.version,
            alignment: parsed.alignment,
            data_start: parsed.data_start,
            metadata: parsed.metadata,
            keys: parsed.keys,
            tensors: parsed.tensors,
            by_name: parsed.by_name,
        })
    }

    /// The whole file, as mapped.
    pub fn file_bytes(&self) -> &[u8] {
        &self.map
    }

    /// The format version, 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data section's alignment.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<T, GgufError> {
        let value = self.require(key)?;
        convert(value).ok_or_else(|| wrong_type(key, expected, value))
    }

    /// Key `key` as a u32 (any integer type whose value fits).
    pub fn u32(&self, key: &str) -> Result<u32, GgufError> {
        self.typed(key, "an integer that fits in u32", Value::as_u32)
    }

    /// Key `key` as a u64 (any integer type whose value fits).
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        self.typed(key, "an integer that fits in u64", Value::as_u64)
    }

    /// Key `key` as an f32 (an f32, or an f64 rounded).
    pub fn f32(&self, key: &str) -> Result<f32, GgufError> {
        self.typed(key, "f32", Value::as_f32)
    }

    /// Key `key` as a bool.
    pub fn bool(&self, key: &str) -> Result<bool, GgufError> {
        self.typed(key, "bool", Value::as_bool)
    }

    /// Key `key` as a string.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        self.typed(key, "string", Value::as_str)
    }

    /// Key `key` as an array of any values.
    pub fn array(&self, key: &str) -> Result<&[Value], GgufError> {
        self.typed(key, "array", Value::as_array)
    }

    fn array_of<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Vec<T>, GgufError> {
        let value = self.require(key)?;
        value
            .as_array()
            .and_then(|items| items.iter().map(convert).collect::<Option<Vec<T>>>())
            .ok_or_else(|| wrong_type(key, expected, value))
    }

    /// Key `key` as an array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.array_of(key, "array of string", Value::as_str)
    }

    /// Key `key` as an array of i32 (integers that fit).
    pub fn i32s(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.array_of(key, "array of i32", Value::as_i32)
    }

    /// Key `key` as an array of f32.
    pub fn f32s(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        self.array_of(key, "array of f32", Value::as_f32)
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of `tensor` (which must come from this file), checked to lie inside it.
    pub fn tensor_bytes(&self, tensor: &TensorInfo) -> Result<&[u8], GgufError> {
        let unsupported = || GgufError::UnsupportedType {
            name: tensor.name.clone(),
            ggml_type: tensor.ggml_type,
        };
        let (start, end) = tensor.span.ok_or_else(unsupported)?;
        self.map
            .get(start..end)
            .ok_or_else(|| GgufError::TensorOutOfBounds {
                name: tensor.name.clone(),
                start: start as u64,
                end: end as u64,
                len: self.map.len() as u64,
            })
    }

    /// The tensor named `name`, dequantized to f32 in file order (`ne0` fastest).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let tensor = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
        self.dequantize_tensor(tensor)
    }

    /// `tensor` (which must come from this file) dequantized to f32, `ne0` fastest.
    pub fn dequantize_tensor(&self, tensor: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let bytes = self.tensor_bytes(tensor)?;
        // Bounded by the file: the bytes are in it and every known type packs at least one
        // element in 4 bytes per 32 / 18.
        let n = usize::try_from(tensor.n_elements).map_err(|_| GgufError::ShapeOverflow {
            name: tensor.name.clone(),
            dims: tensor.dims().to_vec(),
        })?;
        let mut out = vec![0.0; n];
        dequantize_into(tensor.ggml_type, bytes, &mut out)?;
        Ok(out)
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: found.describe(),
    }
}

/// Dequantizes `bytes` of type `ggml_type` into `out`, exactly as ggml's reference
/// `dequantize_row_*` does. `bytes` must hold exactly `out.len()` elements.
pub fn dequantize_into(
    ggml_type: GgmlType,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), GgufError> {
    let bad_length = || GgufError::BadDataLength {
        ggml_type,
        bytes: bytes.len(),
        elements: out.len(),
    };
    let (Some(block), Some(block_bytes)) = (ggml_type.block_size(), ggml_type.block_bytes()) else {
        return Err(GgufError::CannotDequantize(ggml_type));
    };
    if !out.len().is_multiple_of(block) || out.len() / block * block_bytes != bytes.len() {
        return Err(bad_length());
    }
    let blocks = bytes
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(block));
    match ggml_type {
        GgmlType::F32 => {
            for (b, y) in blocks {
                y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, y) in blocks {
                y[0] = f16(b[0], b[1]);
            }
        }
        GgmlType::BF16 => {
            for (b, y) in blocks {
                y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        GgmlType::Q4_0 => {
            for (b, y) in blocks {
                let d = f16(b[0], b[1]);
                let (lo, hi) = y.split_at_mut(16);
                for (j, &q) in b[2..18].iter().enumerate() {
                    // as ggml: an int, widened to float, times d
                    lo[j] = (i32::from(q & 0x0F) - 8) as f32 * d;
                    hi[j] = (i32::from(q >> 4) - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, y) in blocks {
                let d = f16(b[0], b[1]);
                let m = f16(b[2], b[3]);
                let (lo, hi) = y.split_at_mut(16);
                for (j, &q) in b[4..20].iter().enumerate() {
                    // as ggml: a product then a sum, each rounded to f32 (no fused multiply-add)
                    lo[j] = f32::from(q & 0x0F) * d + m;
                    hi[j] = f32::from(q >> 4) * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (b, y) in blocks {
                let d = f16(b[0], b[1]);
                for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
                    *yj = f32::from(i8::from_le_bytes([q])) * d;
                }
            }
        }
        GgmlType::Other(_) => return Err(GgufError::CannotDequantize(ggml_type)),
    }
    Ok(())
}

fn f16(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// magic + version + tensor_count + kv_count
const HEADER_BYTES: u64 = 4 + 4 + 8 + 8;

/// The fewest bytes a tensor info takes: an empty name, n_dims, no dims, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// The fewest bytes a key/value takes: an empty key, the type, a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;

/// What [`parse`] finds in a file's bytes.
#[derive(Debug)]
struct Parsed {
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

/// Parses a whole GGUF file held in `data`, checking every tensor to lie inside it.
fn parse(data: &[u8]) -> Result<Parsed, GgufError> {
    let mut r = Reader { data, pos: 0 };
    let magic: [u8; 4] = r.bytes("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let tensor_count = r.count("tensor count", MIN_TENSOR_INFO_BYTES)?;
    let kv_count = r.count("metadata key/value count", MIN_KV_BYTES)?;

    let mut metadata = Vec::with_capacity(kv_count.min(PREALLOCATE_MAX));
    let mut keys = HashMap::with_capacity(kv_count.min(PREALLOCATE_MAX));
    for _ in 0..kv_count {
        let key = r.string("metadata key")?;
        let value_type = r.value_type()?;
        let value = r.value(value_type, 0)?;
        if keys.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let alignment = match keys.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(&i) => {
            let value = &metadata[i].1;
            let alignment = match value {
                Value::U32(a) => u64::from(*a),
                other => return Err(wrong_type("general.alignment", "u32", other)),
            };
            if !alignment.is_power_of_two() {
                return Err(GgufError::BadAlignment(alignment));
            }
            alignment
        }
    };

    let mut raw = Vec::with_capacity(tensor_count.min(PREALLOCATE_MAX));
    let mut by_name = HashMap::with_capacity(tensor_count.min(PREALLOCATE_MAX));
    for _ in 0..tensor_count {
        let name = r.string("tensor name")?;
        let n_dims = r.u32("tensor dimension count")?;
        let n = usize::try_from(n_dims)
            .ok()
            .filter(|n| (1..=MAX_DIMS).contains(n))
            .ok_or_else(|| GgufError::BadDimCount {
                name: name.clone(),
                n_dims,
            })?;
        let mut ne = [1u64; MAX_DIMS];
        for d in &mut ne[..n] {
            *d = r.u64("tensor dimension")?;
        }
        let ggml_type = GgmlType::from_id(r.u32("tensor type")?);
        let offset = r.u64("tensor offset")?;
        if by_name.insert(name.clone(), raw.len()).is_some() {
            return Err(GgufError::DuplicateTensor(name));
        }
        raw.push((name, ne, n, ggml_type, offset));
    }

    let len = data.len() as u64;
    // The data section starts at the next multiple of the alignment (at the end of the
    // file when no tensor has data).
    let data_start = (r.pos as u64).next_multiple_of(alignment);
    let tensors = raw
        .into_iter()
        .map(|(name, ne, n_dims, ggml_type, offset)| {
            tensor_info(
                name, ne, n_dims, ggml_type, offset, alignment, data_start, len,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;

    Ok(Parsed {
        version,
        alignment,
        data_start,
        metadata,
        keys,
        tensors,
        by_name,
    })
}

/// Checks one tensor's shape, type and place, and builds its info.
#[allow(clippy::too_many_arguments)]
fn tensor_info(
    name: String,
    ne: [u64; MAX_DIMS],
    n_dims: usize,
    ggml_type: GgmlType,
    offset: u64,
    alignment: u64,
    data_start: u64,
    len: u64,
) -> Result<TensorInfo, GgufError> {
    let n_elements = ne
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| GgufError::ShapeOverflow {
            name: name.clone(),
            dims: ne[..n_dims].to_vec(),
        })?;
    if !offset.is_multiple_of(alignment) {
        return Err(GgufError::Misaligned {
            name,
            offset,
            alignment,
        });
    }
    let span = match (ggml_type.block_size(), ggml_type.block_bytes()) {
        (Some(block), Some(block_bytes)) => {
            if !ne[0].is_multiple_of(block as u64) {
                return Err(GgufError::PartialBlock {
                    name,
                    ggml_type,
                    ne0: ne[0],
                    block,
                });
            }
            let start = data_start.checked_add(offset);
            let end = (n_elements / block as u64)
                .checked_mul(block_bytes as u64)
                .and_then(|bytes| start?.checked_add(bytes));
            let span = start
                .zip(end)
                .filter(|&(_, end)| end <= len)
                .and_then(|(s, e)| Some((usize::try_from(s).ok()?, usize::try_from(e).ok()?)));
            if span.is_none() {
                return Err(GgufError::TensorOutOfBounds {
                    name,
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    len,
                });
            }
            span
        }
        _ => None,
    };
    Ok(TensorInfo {
        name,
        ne,
        n_dims,
        ggml_type,
        offset,
        n_elements,
        span,
    })
}

/// The most elements reserved ahead for a count read from the file; beyond it, vectors
/// grow as elements are actually read.
const PREALLOCATE_MAX: usize = 1 << 16;

/// A bounds-checked little-endian cursor over the file's bytes.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.data.len() - self.pos) as u64
    }

    fn truncated(&self, what: &'static str) -> GgufError {
        GgufError::Truncated {
            what,
            offset: self.pos as u64,
            len: self.data.len() as u64,
        }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or_else(|| self.truncated(what))?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn bytes<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, GgufError> {
        Ok(self.bytes::<1>(what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, GgufError> {
        self.bytes(what).map(u16::from_le_bytes)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.bytes(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.bytes(what).map(u64::from_le_bytes)
    }

    /// A u64 count of things taking at least `min_size` bytes each, refused when the rest
    /// of the file cannot hold that many.
    fn count(&mut self, what: &'static str, min_size: u64) -> Result<usize, GgufError> {
        let offset = self.pos as u64;
        let count = self.u64(what)?;
        let remaining = self.remaining();
        match count.checked_mul(min_size) {
            Some(bytes) if bytes <= remaining => {
                usize::try_from(count).map_err(|_| self.truncated(what))
            }
            _ => Err(GgufError::CountTooLarge {
                what,
                offset,
                count,
                remaining,
            }),
        }
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let offset = self.pos as u64;
        let len = self.u64(what)?;
        let len = usize::try_from(len).map_err(|_| self.truncated(what))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { offset })
    }

    fn value_type(&mut self) -> Result<ValueType, GgufError> {
        let offset = self.pos as u64;
        let type_id = self.u32("value type")?;
        ValueType::from_id(type_id).ok_or(GgufError::BadValueType { type_id, offset })
    }

    /// A value of type `t`, inside `depth` arrays.
    fn value(&mut self, t: ValueType, depth: usize) -> Result<Value, GgufError> {
        const W: &str = "metadata value";
        Ok(match t {
            ValueType::U8 => Value::U8(self.u8(W)?),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.bytes(W)?)),
            ValueType::U16 => Value::U16(self.u16(W)?),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.bytes(W)?)),
            ValueType::U32 => Value::U32(self.u32(W)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.bytes(W)?)),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32(W)?)),
            ValueType::U64 => Value::U64(self.u64(W)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.bytes(W)?)),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64(W)?)),
            ValueType::Bool => {
                let offset = self.pos as u64;
                match self.u8(W)? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    value => return Err(GgufError::BadBool { value, offset }),
                }
            }
            ValueType::String => Value::String(self.string("string value")?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep {
                        offset: self.pos as u64,
                    });
                }
                let element = self.value_type()?;
                let n = self.count("array length", element.min_size())?;
                let mut items = Vec::with_capacity(n.min(PREALLOCATE_MAX));
                for _ in 0..n {
                    items.push(self.value(element, depth + 1)?);
                }
                Value::Array(element, items)
            }
        })
    }
}

/// A minimal GGUF writer for tests: metadata and tensors in, file bytes out.
#[cfg(test)]
pub(crate) mod testing {
    use super::{GgmlType, Value};

    /// A GGUF file under construction.
    pub(crate) struct GgufWriter {
        pub(crate) version: u32,
        pub(crate) alignment: u64,
        pub(crate) kvs: Vec<(String, Value)>,
        pub(crate) tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
    }

    impl GgufWriter {
        pub(crate) fn new() -> Self {
            Self {
                version: 3,
                alignment: super::DEFAULT_ALIGNMENT,
                kvs: Vec::new(),
                tensors: Vec::new(),
            }
        }

        pub(crate) fn kv(&mut self, key: &str, value: Value) -> &mut Self {
            self.kvs.push((key.to_owned(), value));
            self
        }

        pub(crate) fn tensor(
            &mut self,
            name: &str,
            dims: &[u64],
            ggml_type: GgmlType,
            bytes: Vec<u8>,
        ) -> &mut Self {
            self.tensors
                .push((name.to_owned(), dims.to_vec(), ggml_type, bytes));
            self
        }

        pub(crate) fn tensor_f32(&mut self, name: &str, dims: &[u64], values: &[f32]) -> &mut Self {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.tensor(name, dims, GgmlType::F32, bytes)
        }

        pub(crate) fn to_bytes(&self) -> Vec<u8> {
            let mut b = Vec::new();
            b.extend_from_slice(b"GGUF");
            b.extend_from_slice(&self.version.to_le_bytes());
            b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            b.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
            for (key, value) in &self.kvs {
                put_string(&mut b, key);
                b.extend_from_slice(&value.value_type().id().to_le_bytes());
                put_value(&mut b, value);
            }
            let align = usize::try_from(self.alignment).expect("test alignment");
            let mut offset = 0usize;
            let mut offsets = Vec::new();
            for (name, dims, ggml_type, bytes) in &self.tensors {
                put_string(&mut b, name);
                b.extend_from_slice(&u32::try_from(dims.len()).unwrap().to_le_bytes());
                for d in dims {
                    b.extend_from_slice(&d.to_le_bytes());
                }
                b.extend_from_slice(&ggml_type.id().to_le_bytes());
                b.extend_from_slice(&(offset as u64).to_le_bytes());
                offsets.push(offset);
                offset = (offset + bytes.len()).next_multiple_of(align);
            }
            if !self.tensors.is_empty() {
                b.resize(b.len().next_multiple_of(align), 0);
            }
            let data_start = b.len();
            for ((_, _, _, bytes), offset) in self.tensors.iter().zip(offsets) {
                b.resize(data_start + offset, 0);
                b.extend_from_slice(bytes);
            }
            b
        }

        pub(crate) fn write(&self, path: &std::path::Path) {
            std::fs::write(path, self.to_bytes()).expect("write test GGUF");
        }
    }

    fn put_string(b: &mut Vec<u8>, s: &str) {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }

    fn put_value(b: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => b.push(*x),
            Value::I8(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => b.push(u8::from(*x)),
            Value::String(s) => put_string(b, s),
            Value::Array(t, items) => {
                b.extend_from_slice(&t.id().to_le_bytes());
                b.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    put_value(b, item);
                }
            }
            Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::GgufWriter;
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        half::f16::from_f32(x).to_bits().to_le_bytes()
    }

    fn deq(t: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; n];
        dequantize_into(t, bytes, &mut out).expect("dequantize");
        out
    }

    #[test]
    fn dequantizes_f32_f16_bf16() {
        let vals = [1.5f32, -0.0, 65504.0, f32::INFINITY];
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(deq(GgmlType::F32, &bytes, 4), vals);

        let bytes: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
        assert_eq!(deq(GgmlType::F16, &bytes, 4), vals);
        // the smallest subnormal half
        assert_eq!(deq(GgmlType::F16, &[1, 0], 1), [2f32.powi(-24)]);

        // bf16 is the top half of an f32: 0x3FC0 = 1.5, 0xC040 = -3.0
        let out = deq(GgmlType::BF16, &[0xC0, 0x3F, 0x40, 0xC0], 2);
        assert_eq!(out, [1.5, -3.0]);
    }

    #[test]
    fn dequantizes_q4_0() {
        // d = 0.5; qs[j] = low nibble j, high nibble 15 - j
        let mut block = h(0.5).to_vec();
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let out = deq(GgmlType::Q4_0, &block, 32);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5, "element {j}");
            assert_eq!(
                out[j + 16],
                ((15 - j) as f32 - 8.0) * 0.5,
                "element {}",
                j + 16
            );
        }
        assert_eq!(out[0], -4.0);
        assert_eq!(out[16], 3.5);
    }

    #[test]
    fn dequantizes_q4_1() {
        // d = 0.25, m = -1.0; two blocks, the second with d = 2, m = 3
        let mut bytes = h(0.25).to_vec();
        bytes.extend(h(-1.0));
        bytes.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        bytes.extend(h(2.0));
        bytes.extend(h(3.0));
        bytes.extend([0xF0u8; 16]);
        let out = deq(GgmlType::Q4_1, &bytes, 64);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.25 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.25 - 1.0);
            assert_eq!(out[32 + j], 3.0);
            assert_eq!(out[48 + j], 15.0 * 2.0 + 3.0);
        }
    }

    #[test]
    fn dequantizes_q8_0() {
        let mut block = h(0.125).to_vec();
        let qs: Vec<i8> = (0..32)
            .map(|j| i8::try_from(j * 8 - 128).unwrap())
            .collect();
        block.extend(qs.iter().flat_map(|q| q.to_le_bytes()));
        let out = deq(GgmlType::Q8_0, &block, 32);
        for j in 0..32 {
            assert_eq!(out[j], f32::from(qs[j]) * 0.125);
        }
        assert_eq!(out[0], -16.0);
        assert_eq!(out[31], 15.0);
    }

    #[test]
    fn dequantize_checks_lengths_and_types() {
        let mut out = [0.0; 32];
        assert!(matches!(
            dequantize_into(GgmlType::Q8_0, &[0; 33], &mut out),
            Err(GgufError::BadDataLength { .. })
        ));
        assert!(matches!(
            dequantize_into(GgmlType::Q4_0, &[0; 18], &mut out[..16]),
            Err(GgufError::BadDataLength { .. })
        ));
        let err = dequantize_into(GgmlType::from_id(12), &[0; 144], &mut out[..0]).unwrap_err();
        assert!(matches!(err, GgufError::CannotDequantize(_)), "{err}");
        assert!(err.to_string().contains("Q4_K"), "{err}");
    }

    fn sample() -> GgufWriter {
        let mut w = GgufWriter::new();
        w.kv("general.architecture", Value::String("llama".into()))
            .kv("u8", Value::U8(7))
            .kv("i8", Value::I8(-7))
            .kv("u16", Value::U16(65535))
            .kv("i16", Value::I16(-300))
            .kv("u32", Value::U32(4_000_000_000))
            .kv("i32", Value::I32(-5))
            .kv("f32", Value::F32(1e-5))
            .kv("bool", Value::Bool(true))
            .kv("u64", Value::U64(1 << 40))
            .kv("i64", Value::I64(-(1 << 40)))
            .kv("f64", Value::F64(0.1))
            .kv(
                "strings",
                Value::Array(
                    ValueType::String,
                    vec![Value::String("a".into()), Value::String("Ġb é".into())],
                ),
            )
            .kv(
                "i32s",
                Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)]),
            )
            .kv("empty", Value::Array(ValueType::F32, vec![]))
            .kv(
                "nested",
                Value::Array(
                    ValueType::Array,
                    vec![
                        Value::Array(ValueType::U8, vec![Value::U8(1), Value::U8(2)]),
                        Value::Array(ValueType::Bool, vec![Value::Bool(false)]),
                    ],
                ),
            );
        let f: Vec<f32> = (0..6).map(|i| i as f32 - 2.5).collect();
        w.tensor_f32("a.weight", &[3, 2], &f);
        let mut q8 = h(0.5).to_vec();
        q8.extend((0..32u8).map(|j| j.wrapping_sub(16)));
        w.tensor("b.weight", &[32], GgmlType::Q8_0, q8);
        w.tensor(
            "c.weight",
            &[2, 1, 1, 2],
            GgmlType::F16,
            [h(1.0), h(-2.0), h(0.5), h(4.0)].concat(),
        );
        w.tensor("d.weight", &[256], GgmlType::from_id(12), vec![0; 144]);
        w
    }

    #[test]
    fn round_trips_metadata_and_tensors() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (version, alignment) in [(3, 32), (2, 64), (3, 1)] {
            let mut w = sample();
            w.version = version;
            if alignment != DEFAULT_ALIGNMENT {
                w.alignment = alignment;
                w.kv(
                    "general.alignment",
                    Value::U32(u32::try_from(alignment).unwrap()),
                );
            }
            let path = dir.path().join(format!("v{version}-a{alignment}.gguf"));
            w.write(&path);
            let g = Gguf::open(&path).expect("open");

            assert_eq!(g.version(), version);
            assert_eq!(g.alignment(), alignment);
            assert_eq!(g.data_start() % alignment, 0);
            assert_eq!(g.metadata().len(), w.kvs.len());
            for ((k, v), (k2, v2)) in g.metadata().iter().zip(&w.kvs) {
                assert_eq!((k, v), (k2, v2));
            }
            assert_eq!(g.str("general.architecture").unwrap(), "llama");
            assert_eq!(g.u32("u8").unwrap(), 7);
            assert_eq!(g.u32("u16").unwrap(), 65535);
            assert_eq!(g.u32("u32").unwrap(), 4_000_000_000);
            assert_eq!(g.u64("u64").unwrap(), 1 << 40);
            assert_eq!(g.get("i16"), Some(&Value::I16(-300)));
            assert_eq!(g.f32("f32").unwrap(), 1e-5);
            assert_eq!(g.f32("f64").unwrap(), 0.1f32);
            assert!(g.bool("bool").unwrap());
            assert_eq!(g.strings("strings").unwrap(), ["a", "Ġb é"]);
            assert_eq!(g.i32s("i32s").unwrap(), [1, -2]);
            assert!(g.f32s("empty").unwrap().is_empty());
            assert_eq!(g.array("nested").unwrap()[0].as_array().unwrap().len(), 2);

            assert!(matches!(g.u32("i32"), Err(GgufError::WrongType { .. })));
            assert!(matches!(g.u32("u64"), Err(GgufError::WrongType { .. })));
            assert!(matches!(g.str("u8"), Err(GgufError::WrongType { .. })));
            assert!(matches!(
                g.strings("i32s"),
                Err(GgufError::WrongType { .. })
            ));
            assert!(matches!(g.u32("nope"), Err(GgufError::MissingKey(_))));

            assert_eq!(g.tensors().len(), 4);
            let a = g.tensor("a.weight").unwrap();
            assert_eq!(a.dims(), [3, 2]);
            assert_eq!(a.ne(), [3, 2, 1, 1]);
            assert_eq!(a.n_elements(), 6);
            assert_eq!(a.ggml_type(), GgmlType::F32);
            assert_eq!(a.offset() % alignment, 0);
            assert_eq!(g.tensor_bytes(a).unwrap().len(), 24);
            assert_eq!(
                g.dequantize("a.weight").unwrap(),
                [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5]
            );

            let b = g.dequantize("b.weight").unwrap();
            assert_eq!(b[0], -8.0);
            assert_eq!(b[31], 7.5);
            assert_eq!(g.tensor("c.weight").unwrap().dims(), [2, 1, 1, 2]);
            assert_eq!(g.dequantize("c.weight").unwrap(), [1.0, -2.0, 0.5, 4.0]);

            let err = g.dequantize("d.weight").unwrap_err();
            assert!(matches!(err, GgufError::UnsupportedType { .. }), "{err}");
            assert!(err.to_string().contains("d.weight") && err.to_string().contains("Q4_K"));
            assert!(matches!(
                g.dequantize("e.weight"),
                Err(GgufError::MissingTensor(_))
            ));
        }
    }

    #[test]
    fn truncated_files_are_errors() {
        let mut w = sample();
        // no tensor of unknown layout, so that the last tensor's bytes end the file
        w.tensors.pop();
        let bytes = w.to_bytes();
        assert!(parse(&bytes).is_ok());
        for cut in 0..bytes.len() {
            assert!(parse(&bytes[..cut]).is_err(), "cut at {cut} parsed");
        }
        // and through the file path, at a few offsets including an empty file
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cut.gguf");
        for cut in [0, 3, 23, 24, 100, bytes.len() - 1] {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            assert!(Gguf::open(&path).is_err(), "cut at {cut} opened");
        }
        assert!(matches!(
            Gguf::open(dir.path().join("absent.gguf")),
            Err(GgufError::Open { .. })
        ));
    }

    /// Overwrites every aligned u32 and u64 of a valid file with hostile values, and flips
    /// every byte of its header and metadata: each must parse or fail, never panic.
    #[test]
    fn corrupt_files_do_not_panic() {
        let bytes = sample().to_bytes();
        let hostile64 = [u64::MAX, u64::MAX / 2, 1 << 32, 1 << 62, 0xFFFF_FFFF, 13];
        for pos in 0..bytes.len().saturating_sub(8) {
            for v in hostile64 {
                let mut b = bytes.clone();
                b[pos..pos + 8].copy_from_slice(&v.to_le_bytes());
                let _ = parse(&b);
            }
            for v in [u32::MAX, 9, 12, 13, 5] {
                let mut b = bytes.clone();
                b[pos..pos + 4].copy_from_slice(&v.to_le_bytes());
                let _ = parse(&b);
            }
            let mut b = bytes.clone();
            b[pos] ^= 0xFF;
            let _ = parse(&b);
        }
    }

    #[test]
    fn refuses_hostile_counts_and_values() {
        let header = |tensors: u64, kvs: u64| {
            let mut b = b"GGUF".to_vec();
            b.extend(3u32.to_le_bytes());
            b.extend(tensors.to_le_bytes());
            b.extend(kvs.to_le_bytes());
            b
        };
        assert!(matches!(
            parse(&header(u64::MAX, 0)),
            Err(GgufError::CountTooLarge { .. })
        ));
        assert!(matches!(
            parse(&header(0, 1 << 40)),
            Err(GgufError::CountTooLarge { .. })
        ));

        let mut bad_magic = header(0, 0);
        bad_magic[0] = b'g';
        assert!(matches!(parse(&bad_magic), Err(GgufError::BadMagic { .. })));
        let mut v1 = header(0, 0);
        v1[4] = 1;
        assert!(matches!(parse(&v1), Err(GgufError::UnsupportedVersion(1))));
        assert!(parse(&header(0, 0)).is_ok());

        // an array claiming 2^40 elements in a short file
        let mut b = header(0, 1);
        b.extend(1u64.to_le_bytes());
        b.push(b'k');
        b.extend(9u32.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend((1u64 << 40).to_le_bytes());
        assert!(matches!(parse(&b), Err(GgufError::CountTooLarge { .. })));

        // arrays nested past the limit
        let mut b = header(0, 1);
        b.extend(1u64.to_le_bytes());
        b.push(b'k');
        b.extend(9u32.to_le_bytes());
        for _ in 0..MAX_ARRAY_DEPTH + 1 {
            b.extend(9u32.to_le_bytes());
            b.extend(1u64.to_le_bytes());
        }
        b.extend([0u8; 64]);
        assert!(matches!(parse(&b), Err(GgufError::NestingTooDeep { .. })));

        let one_kv = |value: Value| {
            let mut w = GgufWriter::new();
            w.kv("k", value);
            w.to_bytes()
        };
        let mut b = one_kv(Value::Bool(true));
        *b.last_mut().unwrap() = 2;
        assert!(matches!(
            parse(&b),
            Err(GgufError::BadBool { value: 2, .. })
        ));
        let mut b = one_kv(Value::String("ab".into()));
        *b.last_mut().unwrap() = 0xFF;
        assert!(matches!(parse(&b), Err(GgufError::BadUtf8 { .. })));
        let mut b = one_kv(Value::U8(0));
        let at = b.len() - 5;
        b[at..at + 4].copy_from_slice(&13u32.to_le_bytes());
        assert!(matches!(
            parse(&b),
            Err(GgufError::BadValueType { type_id: 13, .. })
        ));

        let mut w = GgufWriter::new();
        w.kv("k", Value::U8(0)).kv("k", Value::U8(1));
        assert!(matches!(
            parse(&w.to_bytes()),
            Err(GgufError::DuplicateKey(_))
        ));
        let mut w = GgufWriter::new();
        w.kv("general.alignment", Value::U32(48));
        assert!(matches!(
            parse(&w.to_bytes()),
            Err(GgufError::BadAlignment(48))
        ));
        let mut w = GgufWriter::new();
        w.kv("general.alignment", Value::U64(32));
        assert!(matches!(
            parse(&w.to_bytes()),
            Err(GgufError::WrongType { .. })
        ));
    }

    #[test]
    fn refuses_bad_tensor_infos() {
        let one = |dims: &[u64], t: GgmlType, bytes: usize| {
            let mut w = GgufWriter::new();
            w.tensor("t", dims, t, vec![0; bytes]);
            parse(&w.to_bytes())
        };
        assert!(one(&[4], GgmlType::F32, 16).is_ok());
        assert!(matches!(
            one(&[5], GgmlType::F32, 16),
            Err(GgufError::TensorOutOfBounds { .. })
        ));
        assert!(matches!(
            one(&[16], GgmlType::Q4_1, 20),
            Err(GgufError::PartialBlock { .. })
        ));
        assert!(matches!(
            one(&[1 << 32, 1 << 32, 1 << 32], GgmlType::F32, 4),
            Err(GgufError::ShapeOverflow { .. })
        ));
        assert!(matches!(
            one(&[u64::MAX / 2, 1], GgmlType::F32, 4),
            Err(GgufError::TensorOutOfBounds { .. })
        ));
        assert!(matches!(
            one(&[1, 1, 1, 1, 1], GgmlType::F32, 4),
            Err(GgufError::BadDimCount { n_dims: 5, .. })
        ));

        let mut w = GgufWriter::new();
        w.tensor_f32("t", &[1], &[1.0])
            .tensor_f32("t", &[1], &[2.0]);
        assert!(matches!(
            parse(&w.to_bytes()),
            Err(GgufError::DuplicateTensor(_))
        ));

        // a tensor offset that is not a multiple of the alignment
        let mut w = GgufWriter::new();
        w.tensor_f32("t", &[1], &[1.0]);
        let mut b = w.to_bytes();
        // header, name "t", n_dims, one dim, type: then the offset
        let off_at = 24 + 9 + 4 + 8 + 4;
        b[off_at..off_at + 8].copy_from_slice(&4u64.to_le_bytes());
        assert!(matches!(
            parse(&b),
            Err(GgufError::Misaligned { offset: 4, .. })
        ));
    }

    #[test]
    fn default_model_path_ends_in_the_model_file() {
        // The environment is not changed here (tests run in parallel); only the shape of
        // the answer is checked.
        let p = default_model_path();
        if std::env::var_os("KVFENCE_MODEL").is_none() {
            assert!(p.ends_with(Path::new("kvfence/models").join(DEFAULT_MODEL_FILE)));
        }
    }
}
