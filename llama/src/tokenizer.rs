//! Byte-level BPE (GPT-2 style), as llama.cpp runs it for GGUF vocabularies with
//! `tokenizer.ggml.model = "gpt2"` and `tokenizer.ggml.pre = "smollm"` (SmolLM2).
//!
//! Encoding a text takes four steps:
//!
//! 1. **Added tokens.** The texts of the added tokens are cut out of the text first, longest
//!    token first, each one everywhere it occurs, and become their ids directly: control and
//!    unknown tokens only when the caller asks for it (`parse_special`), user-defined tokens
//!    always (llama.cpp and Hugging Face tokenizers both do so). The rest is plain text.
//! 2. **Pre-tokenization** splits plain text into words. The "smollm" rule is two passes:
//!    every `\p{N}` character becomes a piece of its own, then each piece is split by the
//!    GPT-2 rule `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//!    Since digits are isolated first, a space before a digit stays a word of its own.
//! 3. **Byte mapping.** Each byte of a word becomes one symbol: the character GPT-2's
//!    byte-to-unicode table assigns it (`Ġ` for a space), the alphabet vocabulary strings
//!    are written in.
//! 4. **Merges.** The adjacent pair of symbols whose merge has the lowest rank (the leftmost
//!    on a tie) is merged, again and again, until no pair has a merge; each remaining symbol
//!    is then a token. A priority queue keeps this O(n log n) in the length of a word.
//!
//! Decoding maps each token back to its bytes: GPT-2 characters to the bytes they stand for,
//! added tokens to their text. A token may end inside a UTF-8 sequence, so decoding yields
//! bytes; a streaming decoder joins [`Tokenizer::token_bytes`] of successive tokens.
//!
//! A byte that no token stands for cannot be encoded and is dropped, as llama.cpp drops it.
//! SmolLM2's vocabulary lacks the bytes of six C0 controls (U+0004, U+0006, U+0013, U+0014,
//! U+0016, U+001D) and the UTF-8 lead bytes F1 and F2 of planes 4 to 11 (U+40000 to
//! U+BFFFF, all unassigned); the other bytes it lacks never occur in UTF-8. Every text
//! without those characters round-trips through `encode` and `decode`.
//!
//! Character classes (`\p{L}`, `\p{N}`, `\s`) are Unicode 15.1's general categories and its
//! White_Space property, the data llama.cpp's own tables hold (checked against them for
//! every code point). The Rust standard library follows a newer Unicode, under which the
//! letters and digits first assigned in Unicode 16 would split differently; and
//! `char::is_alphabetic` is a different property (it includes combining vowel signs).

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Range;

use crate::gguf::{Gguf, GgufError};

/// A failure to build a [`Tokenizer`] from vocabulary data.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The vocabulary has no token at all.
    #[error("build tokenizer: the vocabulary is empty")]
    EmptyVocabulary,
    /// The token list and the token type list differ in length.
    #[error("build tokenizer: {tokens} tokens but {token_types} token types")]
    TypeCountMismatch { tokens: usize, token_types: usize },
    /// More tokens or merges than a `u32` can number.
    #[error("build tokenizer: {count} {what} exceed the u32 id space")]
    TooMany { what: &'static str, count: usize },
    /// A merge is not two parts separated by a space.
    #[error("build tokenizer: merge {index} ({merge:?}) is not two space-separated parts")]
    MalformedMerge { index: usize, merge: String },
    /// A special token id (BOS, EOS) lies outside the vocabulary.
    #[error("build tokenizer: {which} token id {id} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange {
        which: &'static str,
        id: u32,
        vocab_size: usize,
    },
    /// A tokenizer key of the model file is missing or of the wrong type.
    #[error("read tokenizer metadata")]
    Metadata(#[source] GgufError),
    /// The model file names a tokenizer this module does not implement.
    #[error("tokenizer {key} = {value:?} is not supported (only {supported:?})")]
    Unsupported {
        key: &'static str,
        value: String,
        supported: &'static str,
    },
}

/// The role of a vocabulary entry (GGUF `tokenizer.ggml.token_type`, llama.cpp's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// A type number llama.cpp does not define (0 included).
    Undefined,
    /// An ordinary token, written in GPT-2's byte alphabet and produced by merges.
    Normal,
    /// The unknown token.
    Unknown,
    /// A control token such as `<|im_start|>`: matched in text only on request.
    Control,
    /// A user-defined added token: always matched in text.
    UserDefined,
    /// A reserved, unused entry.
    Unused,
    /// A byte token written `<0xXX>`.
    Byte,
}

impl TokenType {
    /// The type a GGUF `token_type` number names.
    pub fn from_gguf(value: i32) -> TokenType {
        match value {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Whether tokens of this type are added tokens: cut out of text by their literal text
    /// (step 1 of encoding), decoded to that text, and never the result of merges.
    pub fn is_added(self) -> bool {
        matches!(
            self,
            TokenType::Control | TokenType::Unknown | TokenType::UserDefined
        )
    }
}

/// Sentinel index: no symbol, or no piece.
const NONE: usize = usize::MAX;

/// A byte-level BPE tokenizer over a GGUF vocabulary.
///
/// Token ids are indices into the vocabulary. Building one checks the data; encoding and
/// decoding then never fail: every `&str` encodes, and every id list decodes (an id outside
/// the vocabulary decodes to nothing).
pub struct Tokenizer {
    /// Vocabulary strings, by id.
    texts: Vec<String>,
    /// Token types, by id.
    types: Vec<TokenType>,
    /// The bytes each token decodes to, by id.
    bytes: Vec<Box<[u8]>>,
    /// Merges, keyed by the piece ids of their two parts.
    merges: HashMap<(usize, usize), Merge, BuildHasherDefault<PairHasher>>,
    /// The piece id of each byte's one-character string, [`NONE`] where neither a token
    /// nor a merge has that string (the byte then takes part in no merge).
    byte_piece: [usize; 256],
    /// The token that stands for each byte alone, where the vocabulary has one.
    byte_token: [Option<u32>; 256],
    /// Added tokens in the order they are cut out of text: longest text first, then by id.
    added: Vec<u32>,
    /// Text to id of the added tokens.
    added_ids: HashMap<String, u32>,
    bos: Option<u32>,
    eos: u32,
}

/// The result of merging two pieces.
#[derive(Clone, Copy, Debug)]
struct Merge {
    /// Priority: the merge's index in the merge list; lower merges first.
    rank: u32,
    /// The merged piece.
    piece: usize,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.texts.len())
            .field("merges", &self.merges.len())
            .field("added_tokens", &self.added.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Tokenizer {
    /// Builds a tokenizer from a vocabulary (`tokens[id]`, written in GPT-2's byte
    /// alphabet), its merges (`"left right"`, rank = index), the token types (GGUF
    /// numbering, see [`TokenType`]) and the BOS and EOS ids.
    ///
    /// As in llama.cpp, a string listed twice in the vocabulary names its last id, and a
    /// merge listed twice keeps its first rank.
    pub fn new(
        tokens: Vec<String>,
        merges: Vec<String>,
        token_types: Vec<i32>,
        bos: Option<u32>,
        eos: u32,
    ) -> Result<Tokenizer, TokenizerError> {
        if tokens.is_empty() {
            return Err(TokenizerError::EmptyVocabulary);
        }
        if tokens.len() != token_types.len() {
            return Err(TokenizerError::TypeCountMismatch {
                tokens: tokens.len(),
                token_types: token_types.len(),
            });
        }
        let vocab_size = tokens.len();
        for (what, count) in [("tokens", vocab_size), ("merges", merges.len())] {
            if u32::try_from(count).is_err() {
                return Err(TokenizerError::TooMany { what, count });
            }
        }
        for (which, id) in [("BOS", bos), ("EOS", Some(eos))] {
            if let Some(id) = id.filter(|&id| id as usize >= vocab_size) {
                return Err(TokenizerError::TokenOutOfRange {
                    which,
                    id,
                    vocab_size,
                });
            }
        }
        let types: Vec<TokenType> = token_types.into_iter().map(TokenType::from_gguf).collect();

        let mut pieces = Pieces::new(&tokens);
        let mut merge_map: HashMap<(usize, usize), Merge, BuildHasherDefault<PairHasher>> =
            HashMap::with_capacity_and_hasher(merges.len(), BuildHasherDefault::default());
        for (index, merge) in merges.iter().enumerate() {
            // The parts are split at the first space after the first byte (llama.cpp's
            // rule); a space is ASCII, so both sides are whole strings.
            let split = merge.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
            let Some(split) = split else {
                return Err(TokenizerError::MalformedMerge {
                    index,
                    merge: merge.clone(),
                });
            };
            let (left, right) = (&merge[..split], &merge[split + 1..]);
            let key = (pieces.intern(left), pieces.intern(right));
            let piece = pieces.intern(&[left, right].concat());
            let rank = u32::try_from(index).unwrap_or(u32::MAX);
            if let Entry::Vacant(slot) = merge_map.entry(key) {
                slot.insert(Merge { rank, piece });
            }
        }

        let mut byte_piece = [NONE; 256];
        let mut byte_token = [None; 256];
        let mut utf8 = [0u8; 4];
        for (b, c) in BYTE_CHARS.iter().enumerate() {
            let piece = pieces.get(c.encode_utf8(&mut utf8)).unwrap_or(NONE);
            byte_piece[b] = piece;
            if piece < vocab_size && !types[piece].is_added() {
                byte_token[b] = u32::try_from(piece).ok();
            }
        }
        drop(pieces);

        let mut added: Vec<u32> = Vec::new();
        let mut added_ids = HashMap::new();
        let mut bytes = Vec::with_capacity(vocab_size);
        for (id, (text, &ty)) in tokens.iter().zip(&types).enumerate() {
            // Every id fits: the vocabulary size was checked above.
            let id = u32::try_from(id).unwrap_or(u32::MAX);
            if ty.is_added() && !text.is_empty() {
                added.push(id);
                added_ids.insert(text.clone(), id);
            }
            bytes.push(token_bytes_of(text, ty));
        }
        added.sort_by_key(|&id| (Reverse(tokens[id as usize].len()), id));

        Ok(Tokenizer {
            texts: tokens,
            types,
            bytes,
            merges: merge_map,
            byte_piece,
            byte_token,
            added,
            added_ids,
            bos,
            eos,
        })
    }

    /// Builds the tokenizer a GGUF model file describes: `tokenizer.ggml.tokens`, `.merges`,
    /// `.token_type`, `.bos_token_id` (optional) and `.eos_token_id`. The file must name the
    /// tokenizer implemented here, `tokenizer.ggml.model = "gpt2"` with
    /// `tokenizer.ggml.pre = "smollm"`: another pre-tokenizer would split text differently.
    pub fn from_gguf(gguf: &Gguf) -> Result<Tokenizer, TokenizerError> {
        for (key, supported) in [
            ("tokenizer.ggml.model", "gpt2"),
            ("tokenizer.ggml.pre", "smollm"),
        ] {
            let value = gguf.str(key).map_err(TokenizerError::Metadata)?;
            if value != supported {
                return Err(TokenizerError::Unsupported {
                    key,
                    value: value.to_owned(),
                    supported,
                });
            }
        }
        let strings = |key| {
            gguf.strings(key)
                .map(|v| v.into_iter().map(str::to_owned).collect::<Vec<String>>())
                .map_err(TokenizerError::Metadata)
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types = gguf
            .i32s("tokenizer.ggml.token_type")
            .map_err(TokenizerError::Metadata)?;
        let bos = match gguf.get("tokenizer.ggml.bos_token_id") {
            None => None,
            Some(_) => Some(
                gguf.u32("tokenizer.ggml.bos_token_id")
                    .map_err(TokenizerError::Metadata)?,
            ),
        };
        let eos = gguf
            .u32("tokenizer.ggml.eos_token_id")
            .map_err(TokenizerError::Metadata)?;
        Tokenizer::new(tokens, merges, types, bos, eos)
    }

    /// The number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    /// The beginning-of-sequence token, where the vocabulary names one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token.
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// The id of the added token (control, unknown or user-defined) whose text is `text`.
    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.added_ids.get(text).copied()
    }

    /// Whether `id` is an added token (control, unknown or user-defined), such as
    /// `<|im_end|>`: one that stands for a literal text rather than for bytes of prose.
    pub fn is_special(&self, id: u32) -> bool {
        self.token_type(id).is_some_and(TokenType::is_added)
    }

    /// The type of token `id`, `None` outside the vocabulary.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// The vocabulary string of token `id` as the GGUF file writes it (in GPT-2's byte
    /// alphabet for normal tokens), `None` outside the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The bytes token `id` decodes to, `None` outside the vocabulary. They may be part of
    /// a UTF-8 sequence that the next tokens complete.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(|b| &b[..])
    }

    /// The bytes a token sequence decodes to: the concatenation of [`Self::token_bytes`],
    /// added tokens as their text. Ids outside the vocabulary are skipped.
    pub fn decode(&self, tokens: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in tokens {
            if let Some(b) = self.token_bytes(id) {
                out.extend_from_slice(b);
            }
        }
        out
    }

    /// Encodes `text`. With `parse_special`, the texts of control tokens (such as
    /// `<|im_start|>`) in `text` become those tokens; without it they are encoded as the
    /// plain characters they are made of, so untrusted text cannot inject them. No BOS is
    /// added.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_into(text, parse_special, &mut out);
        out
    }

    /// [`Self::encode`], appending to `out`.
    pub fn encode_into(&self, text: &str, parse_special: bool, out: &mut Vec<u32>) {
        let mut scratch = Scratch::default();
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(text) => self.encode_plain(text, &mut scratch, out),
            }
        }
    }

    /// Step 1: cuts the added tokens out of `text`, longest first, each at every
    /// non-overlapping occurrence from the left (llama.cpp's `tokenizer_st_partition`).
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(text));
        for &id in &self.added {
            let idx = id as usize;
            if !parse_special && self.types[idx] != TokenType::UserDefined {
                continue;
            }
            let needle = self.texts[idx].as_str();
            let present = fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)));
            if !present {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(t) = fragment else {
                    next.push(fragment);
                    continue;
                };
                let mut rest = 0;
                for (at, _) in t.match_indices(needle) {
                    if at > rest {
                        next.push(Fragment::Text(&t[rest..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = at + needle.len();
                }
                if rest < t.len() {
                    next.push(Fragment::Text(&t[rest..]));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// Steps 2 to 4 for text free of added tokens.
    fn encode_plain(&self, text: &str, scratch: &mut Scratch, out: &mut Vec<u32>) {
        pretokenize(text, &mut scratch.chars, &mut scratch.words);
        let words = std::mem::take(&mut scratch.words);
        for word in &words {
            self.merge_word(&text.as_bytes()[word.clone()], scratch, out);
        }
        scratch.words = words;
    }

    /// Steps 3 and 4 for one word.
    fn merge_word(&self, word: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if let [b] = word {
            out.extend(self.byte_token[usize::from(*b)]);
            return;
        }
        let symbols = &mut scratch.symbols;
        let queue = &mut scratch.queue;
        symbols.clear();
        queue.clear();
        for (i, &b) in word.iter().enumerate() {
            symbols.push(Symbol {
                piece: self.byte_piece[usize::from(b)],
                start: i,
                len: 1,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 < word.len() { i + 1 } else { NONE },
            });
        }
        for i in 1..symbols.len() {
            self.propose(symbols, queue, i - 1, i);
        }
        while let Some(Reverse(c)) = queue.pop() {
            let (left, right) = (symbols[c.left], symbols[c.right]);
            // Stale: one side has merged since this pair was proposed.
            if left.len == 0
                || right.len == 0
                || left.next != c.right
                || left.piece != c.left_piece
                || right.piece != c.right_piece
            {
                continue;
            }
            symbols[c.left] = Symbol {
                piece: c.merged,
                len: left.len + right.len,
                next: right.next,
                ..left
            };
            symbols[c.right].len = 0;
            if right.next != NONE {
                symbols[right.next].prev = c.left;
            }
            self.propose(symbols, queue, left.prev, c.left);
            self.propose(symbols, queue, c.left, right.next);
        }
        // Symbol 0 never merges into another, so the chain starts there.
        let mut at = 0;
        while at != NONE {
            let s = symbols[at];
            match u32::try_from(s.piece) {
                Ok(id) if s.piece < self.texts.len() && !self.types[s.piece].is_added() => {
                    out.push(id);
                }
                // A merge result that is no token (or is an added token's text): the bytes
                // it covers, one token each.
                _ => {
                    let covered = &word[s.start..s.start + s.len];
                    out.extend(
                        covered
                            .iter()
                            .filter_map(|&b| self.byte_token[usize::from(b)]),
                    );
                }
            }
            at = s.next;
        }
    }

    /// Queues the merge of symbols `left` and `right`, if they have one.
    fn propose(&self, symbols: &[Symbol], queue: &mut MergeQueue, left: usize, right: usize) {
        if left == NONE || right == NONE {
            return;
        }
        let (lp, rp) = (symbols[left].piece, symbols[right].piece);
        if lp == NONE || rp == NONE {
            return;
        }
        if let Some(m) = self.merges.get(&(lp, rp)) {
            queue.push(Reverse(Candidate {
                rank: m.rank,
                left,
                right,
                left_piece: lp,
                right_piece: rp,
                merged: m.piece,
            }));
        }
    }
}

/// The strings merges work on, numbered: a vocabulary string is its token id (the last
/// one, for a string listed twice), and strings only merges name are numbered after them.
struct Pieces<'v> {
    vocab: HashMap<&'v str, usize>,
    extra: HashMap<String, usize>,
    next: usize,
}

impl<'v> Pieces<'v> {
    fn new(tokens: &'v [String]) -> Pieces<'v> {
        let mut vocab = HashMap::with_capacity(tokens.len());
        for (id, text) in tokens.iter().enumerate() {
            vocab.insert(text.as_str(), id);
        }
        Pieces {
            vocab,
            extra: HashMap::new(),
            next: tokens.len(),
        }
    }

    fn get(&self, s: &str) -> Option<usize> {
        self.vocab.get(s).or_else(|| self.extra.get(s)).copied()
    }

    fn intern(&mut self, s: &str) -> usize {
        if let Some(p) = self.get(s) {
            return p;
        }
        let p = self.next;
        self.next += 1;
        self.extra.insert(s.to_owned(), p);
        p
    }
}

/// The bytes a token of type `ty` with vocabulary string `text` decodes to (llama.cpp's
/// `token_to_piece` with special tokens rendered).
fn token_bytes_of(text: &str, ty: TokenType) -> Box<[u8]> {
    match ty {
        TokenType::Control | TokenType::Unknown | TokenType::UserDefined => text.as_bytes().into(),
        TokenType::Normal => decode_byte_chars(text),
        TokenType::Byte => match parse_byte_token(text) {
            Some(b) => Box::new([b]),
            None => decode_byte_chars(text),
        },
        TokenType::Unused | TokenType::Undefined => Box::default(),
    }
}

/// The bytes a string in GPT-2's byte alphabet stands for. A character outside that
/// alphabet (no real vocabulary has one) stands for its own UTF-8 encoding.
fn decode_byte_chars(text: &str) -> Box<[u8]> {
    let mut out = Vec::with_capacity(text.len());
    let mut utf8 = [0u8; 4];
    for c in text.chars() {
        match char_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes()),
        }
    }
    out.into()
}

/// The byte of a `<0xXX>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// GPT-2's byte-to-unicode table: the printable bytes `!`..=`~`, `¡`..=`¬` and `®`..=`ÿ`
/// stand for themselves; the other 68 bytes, in order, for U+0100 onwards.
const BYTE_CHARS: [char; 256] = byte_chars();

/// Whether byte `b` is one of those that stand for themselves in [`BYTE_CHARS`].
const fn is_printable_byte(b: u32) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

const fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut shifted = 0;
    let mut b = 0;
    while b < 256 {
        let code = if is_printable_byte(b) {
            b
        } else {
            shifted += 1;
            0x100 + shifted - 1
        };
        table[b as usize] = match char::from_u32(code) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    table
}

/// The byte a character of GPT-2's byte alphabet stands for (the inverse of
/// [`BYTE_CHARS`]).
fn char_byte(c: char) -> Option<u8> {
    let code = u32::from(c);
    if is_printable_byte(code) {
        return u8::try_from(code).ok();
    }
    // The n-th non-printable byte stands for U+0100 + n.
    let n = code.checked_sub(0x100)?;
    (0u8..=255)
        .filter(|&b| !is_printable_byte(u32::from(b)))
        .nth(usize::try_from(n).ok()?)
}

/// A piece of text after step 1.
#[derive(Clone, Copy, Debug)]
enum Fragment<'t> {
    /// Plain text, to pre-tokenize and merge.
    Text(&'t str),
    /// An added token cut out of the text.
    Token(u32),
}

/// Buffers reused across the words of one encode call.
#[derive(Default)]
struct Scratch {
    chars: Vec<CharInfo>,
    words: Vec<Range<usize>>,
    symbols: Vec<Symbol>,
    queue: MergeQueue,
}

type MergeQueue = BinaryHeap<Reverse<Candidate>>;

/// One symbol of a word being merged: a run of the word's bytes, linked to its neighbours.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    /// Its piece id ([`NONE`] for a byte whose character no token or merge has).
    piece: usize,
    /// The byte range it covers; `len == 0` once merged into its left neighbour.
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

/// A proposed merge, ordered by rank, then by position (leftmost first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    rank: u32,
    left: usize,
    right: usize,
    left_piece: usize,
    right_piece: usize,
    merged: usize,
}

/// A hasher for the merge table's pairs of piece ids (splitmix64's mixer): much cheaper
/// than the default SipHash on the encoding hot path; the keys come from the vocabulary,
/// not from the text being encoded.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        let mut z = (self.0.rotate_left(32) ^ v).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        self.0 = z ^ (z >> 31);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// The class of a character for pre-tokenization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// `\p{L}`.
    Letter,
    /// `\p{N}`.
    Number,
    /// `\s`: the White_Space property.
    Space,
    /// Anything else: punctuation, symbols, marks, controls, unassigned code points.
    Other,
}

fn classify(c: char) -> Class {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            '\t' | '\n' | '\u{0B}' | '\u{0C}' | '\r' | ' ' => Class::Space,
            _ => Class::Other,
        };
    }
    if matches!(
        c,
        '\u{85}' | '\u{A0}' | '\u{1680}' | '\u{2000}'
            ..='\u{200A}' | '\u{2028}' | '\u{2029}' | '\u{202F}' | '\u{205F}' | '\u{3000}'
    ) {
        Class::Space
    } else if in_ranges(unicode::LETTER, c) {
        Class::Letter
    } else if in_ranges(unicode::NUMBER, c) {
        Class::Number
    } else {
        Class::Other
    }
}

/// Whether `c` lies in one of the sorted, disjoint inclusive `ranges`.
fn in_ranges(ranges: &[(u32, u32)], c: char) -> bool {
    let c = u32::from(c);
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// A character of the text being pre-tokenized.
#[derive(Clone, Copy, Debug)]
struct CharInfo {
    /// Its byte offset in the text.
    at: usize,
    c: char,
    class: Class,
}

/// Step 2: splits `text` into words (byte ranges, in order, covering all of `text`).
fn pretokenize(text: &str, chars: &mut Vec<CharInfo>, words: &mut Vec<Range<usize>>) {
    chars.clear();
    words.clear();
    chars.extend(text.char_indices().map(|(at, c)| CharInfo {
        at,
        c,
        class: classify(c),
    }));
    // First pass: each `\p{N}` alone; the runs between them go to the second pass.
    let mut run = 0;
    for i in 0..chars.len() {
        if chars[i].class == Class::Number {
            split_gpt2(chars, run..i, text.len(), words);
            words.push(chars[i].at..byte_offset(chars, i + 1, text.len()));
            run = i + 1;
        }
    }
    split_gpt2(chars, run..chars.len(), text.len(), words);
}

/// The byte offset of character `i` (`text_len` past the last one).
fn byte_offset(chars: &[CharInfo], i: usize, text_len: usize) -> usize {
    chars.get(i).map_or(text_len, |ch| ch.at)
}

/// The second pass: the GPT-2 rule over the characters `span` (character indices), which
/// lookarounds do not see past, as llama.cpp's `unicode_regex_split_custom_gpt2` runs it.
fn split_gpt2(
    chars: &[CharInfo],
    span: Range<usize>,
    text_len: usize,
    words: &mut Vec<Range<usize>>,
) {
    let end = span.end;
    let class_at = |p: usize| (p < end).then(|| chars[p].class);
    let char_at = |p: usize| (p < end).then(|| chars[p].c);
    let mut pos = span.start;
    let mut emitted = pos;
    let mut emit = |to: usize, words: &mut Vec<Range<usize>>| {
        if to > emitted {
            words.push(byte_offset(chars, emitted, text_len)..byte_offset(chars, to, text_len));
        }
        emitted = to;
    };
    while pos < end {
        let c = chars[pos].c;
        // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive)
        if c == '\'' {
            match (char_at(pos + 1), char_at(pos + 2)) {
                (Some('s' | 't' | 'm' | 'd'), _) => {
                    pos += 2;
                    emit(pos, words);
                    continue;
                }
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => {
                    pos += 3;
                    emit(pos, words);
                    continue;
                }
                _ => {}
            }
        }
        // ` ?X+` for X in \p{L}, \p{N} and [^\s\p{L}\p{N}]: the class after an optional
        // leading space decides.
        let leading_space = usize::from(c == ' ');
        let class = if c == ' ' {
            class_at(pos + 1)
        } else {
            Some(chars[pos].class)
        };
        if let Some(class @ (Class::Letter | Class::Number | Class::Other)) = class {
            pos += leading_space;
            while class_at(pos) == Some(class) {
                pos += 1;
            }
            emit(pos, words);
            continue;
        }
        // \s+(?!\S) then \s+: a run of spaces followed by more text leaves its last space
        // to lead the next word.
        let mut spaces = 0;
        while class_at(pos + spaces) == Some(Class::Space) {
            spaces += 1;
        }
        pos += if spaces > 1 && pos + spaces < end {
            spaces - 1
        } else {
            spaces.max(1)
        };
        emit(pos, words);
    }
}

/// Unicode 15.1 character data (generated from the Unicode Character Database).
mod unicode {
    /// `\p{L}`: the code point ranges (inclusive) of general category L (Lu, Ll, Lt, Lm,
    /// Lo) in Unicode 15.1.
    #[rustfmt::skip]
    pub(super) const LETTER: &[(u32, u32)] = &[
        (0x41, 0x5A), (0x61, 0x7A), (0xAA, 0xAA), (0xB5, 0xB5), (0xBA, 0xBA), (0xC0, 0xD6),
        (0xD8, 0xF6), (0xF8, 0x2C1), (0x2C6, 0x2D1), (0x2E0, 0x2E4), (0x2EC, 0x2EC),
        (0x2EE, 0x2EE), (0x370, 0x374), (0x376, 0x377), (0x37A, 0x37D), (0x37F, 0x37F),
        (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5),
        (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556), (0x559, 0x559), (0x560, 0x588),
        (0x5D0, 0x5EA), (0x5EF, 0x5F2), (0x620, 0x64A), (0x66E, 0x66F), (0x671, 0x6D3),
        (0x6D5, 0x6D5), (0x6E5, 0x6E6), (0x6EE, 0x6EF), (0x6FA, 0x6FC), (0x6FF, 0x6FF),
        (0x710, 0x710), (0x712, 0x72F), (0x74D, 0x7A5), (0x7B1, 0x7B1), (0x7CA, 0x7EA),
        (0x7F4, 0x7F5), (0x7FA, 0x7FA), (0x800, 0x815), (0x81A, 0x81A), (0x824, 0x824),
        (0x828, 0x828), (0x840, 0x858), (0x860, 0x86A), (0x870, 0x887), (0x889, 0x88E),
        (0x8A0, 0x8C9), (0x904, 0x939), (0x93D, 0x93D), (0x950, 0x950), (0x958, 0x961),
        (0x971, 0x980), (0x985, 0x98C), (0x98F, 0x990), (0x993, 0x9A8), (0x9AA, 0x9B0),
        (0x9B2, 0x9B2), (0x9B6, 0x9B9), (0x9BD, 0x9BD), (0x9CE, 0x9CE), (0x9DC, 0x9DD),
        (0x9DF, 0x9E1), (0x9F0, 0x9F1), (0x9FC, 0x9FC), (0xA05, 0xA0A), (0xA0F, 0xA10),
        (0xA13, 0xA28), (0xA2A, 0xA30), (0xA32, 0xA33), (0xA35, 0xA36), (0xA38, 0xA39),
        (0xA59, 0xA5C), (0xA5E, 0xA5E), (0xA72, 0xA74), (0xA85, 0xA8D), (0xA8F, 0xA91),
        (0xA93, 0xAA8), (0xAAA, 0xAB0), (0xAB2, 0xAB3), (0xAB5, 0xAB9), (0xABD, 0xABD),
        (0xAD0, 0xAD0), (0xAE0, 0xAE1), (0xAF9, 0xAF9), (0xB05, 0xB0C), (0xB0F, 0xB10),
        (0xB13, 0xB28), (0xB2A, 0xB30), (0xB32, 0xB33), (0xB35, 0xB39), (0xB3D, 0xB3D),
        (0xB5C, 0xB5D), (0xB5F, 0xB61), (0xB71, 0xB71), (0xB83, 0xB83), (0xB85, 0xB8A),
        (0xB8E, 0xB90), (0xB92, 0xB95), (0xB99, 0xB9A), (0xB9C, 0xB9C), (0xB9E, 0xB9F),
        (0xBA3, 0xBA4), (0xBA8, 0xBAA), (0xBAE, 0xBB9), (0xBD0, 0xBD0), (0xC05, 0xC0C),
        (0xC0E, 0xC10), (0xC12, 0xC28), (0xC2A, 0xC39), (0xC3D, 0xC3D), (0xC58, 0xC5A),
        (0xC5D, 0xC5D), (0xC60, 0xC61), (0xC80, 0xC80), (0xC85, 0xC8C), (0xC8E, 0xC90),
        (0xC92, 0xCA8), (0xCAA, 0xCB3), (0xCB5, 0xCB9), (0xCBD, 0xCBD), (0xCDD, 0xCDE),
        (0xCE0, 0xCE1), (0xCF1, 0xCF2), (0xD04, 0xD0C), (0xD0E, 0xD10), (0xD12, 0xD3A),
        (0xD3D, 0xD3D), (0xD4E, 0xD4E), (0xD54, 0xD56), (0xD5F, 0xD61), (0xD7A, 0xD7F),
        (0xD85, 0xD96), (0xD9A, 0xDB1), (0xDB3, 0xDBB), (0xDBD, 0xDBD), (0xDC0, 0xDC6),
        (0xE01, 0xE30), (0xE32, 0xE33), (0xE40, 0xE46), (0xE81, 0xE82), (0xE84, 0xE84),
        (0xE86, 0xE8A), (0xE8C, 0xEA3), (0xEA5, 0xEA5), (0xEA7, 0xEB0), (0xEB2, 0xEB3),
        (0xEBD, 0xEBD), (0xEC0, 0xEC4), (0xEC6, 0xEC6), (0xEDC, 0xEDF), (0xF00, 0xF00),
        (0xF40, 0xF47), (0xF49, 0xF6C), (0xF88, 0xF8C), (0x1000, 0x102A), (0x103F, 0x103F),
        (0x1050, 0x1055), (0x105A, 0x105D), (0x1061, 0x1061), (0x1065, 0x1066), (0x106E, 0x1070),
        (0x1075, 0x1081), (0x108E, 0x108E), (0x10A0, 0x10C5), (0x10C7, 0x10C7), (0x10CD, 0x10CD),
        (0x10D0, 0x10FA), (0x10FC, 0x1248), (0x124A, 0x124D), (0x1250, 0x1256), (0x1258, 0x1258),
        (0x125A, 0x125D), (0x1260, 0x1288), (0x128A, 0x128D), (0x1290, 0x12B0), (0x12B2, 0x12B5),
        (0x12B8, 0x12BE), (0x12C0, 0x12C0), (0x12C2, 0x12C5), (0x12C8, 0x12D6), (0x12D8, 0x1310),
        (0x1312, 0x1315), (0x1318, 0x135A), (0x1380, 0x138F), (0x13A0, 0x13F5), (0x13F8, 0x13FD),
        (0x1401, 0x166C), (0x166F, 0x167F), (0x1681, 0x169A), (0x16A0, 0x16EA), (0x16F1, 0x16F8),
        (0x1700, 0x1711), (0x171F, 0x1731), (0x1740, 0x1751), (0x1760, 0x176C), (0x176E, 0x1770),
        (0x1780, 0x17B3), (0x17D7, 0x17D7), (0x17DC, 0x17DC), (0x1820, 0x1878), (0x1880, 0x1884),
        (0x1887, 0x18A8), (0x18AA, 0x18AA), (0x18B0, 0x18F5), (0x1900, 0x191E), (0x1950, 0x196D),
        (0x1970, 0x1974), (0x1980, 0x19AB), (0x19B0, 0x19C9), (0x1A00, 0x1A16), (0x1A20, 0x1A54),
        (0x1AA7, 0x1AA7), (0x1B05, 0x1B33), (0x1B45, 0x1B4C), (0x1B83, 0x1BA0), (0x1BAE, 0x1BAF),
        (0x1BBA, 0x1BE5), (0x1C00, 0x1C23), (0x1C4D, 0x1C4F), (0x1C5A, 0x1C7D), (0x1C80, 0x1C88),
        (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF), (0x1CE9, 0x1CEC), (0x1CEE, 0x1CF3), (0x1CF5, 0x1CF6),
        (0x1CFA, 0x1CFA), (0x1D00, 0x1DBF), (0x1E00, 0x1F15), (0x1F18, 0x1F1D), (0x1F20, 0x1F45),
        (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D),
        (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4),
        (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4),
        (0x1FF6, 0x1FFC), (0x2071, 0x2071), (0x207F, 0x207F), (0x2090, 0x209C), (0x2102, 0x2102),
        (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124),
        (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2139), (0x213C, 0x213F),
        (0x2145, 0x2149), (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2CE4), (0x2CEB, 0x2CEE),
        (0x2CF2, 0x2CF3), (0x2D00, 0x2D25), (0x2D27, 0x2D27), (0x2D2D, 0x2D2D), (0x2D30, 0x2D67),
        (0x2D6F, 0x2D6F), (0x2D80, 0x2D96), (0x2DA0, 0x2DA6), (0x2DA8, 0x2DAE), (0x2DB0, 0x2DB6),
        (0x2DB8, 0x2DBE), (0x2DC0, 0x2DC6), (0x2DC8, 0x2DCE), (0x2DD0, 0x2DD6), (0x2DD8, 0x2DDE),
        (0x2E2F, 0x2E2F), (0x3005, 0x3006), (0x3031, 0x3035), (0x303B, 0x303C), (0x3041, 0x3096),
        (0x309D, 0x309F), (0x30A1, 0x30FA), (0x30FC, 0x30FF), (0x3105, 0x312F), (0x3131, 0x318E),
        (0x31A0, 0x31BF), (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0xA48C), (0xA4D0, 0xA4FD),
        (0xA500, 0xA60C), (0xA610, 0xA61F), (0xA62A, 0xA62B), (0xA640, 0xA66E), (0xA67F, 0xA69D),
        (0xA6A0, 0xA6E5), (0xA717, 0xA71F), (0xA722, 0xA788), (0xA78B, 0xA7CA), (0xA7D0, 0xA7D1),
        (0xA7D3, 0xA7D3), (0xA7D5, 0xA7D9), (0xA7F2, 0xA801), (0xA803, 0xA805), (0xA807, 0xA80A),
        (0xA80C, 0xA822), (0xA840, 0xA873), (0xA882, 0xA8B3), (0xA8F2, 0xA8F7), (0xA8FB, 0xA8FB),
        (0xA8FD, 0xA8FE), (0xA90A, 0xA925), (0xA930, 0xA946), (0xA960, 0xA97C), (0xA984, 0xA9B2),
        (0xA9CF, 0xA9CF), (0xA9E0, 0xA9E4), (0xA9E6, 0xA9EF), (0xA9FA, 0xA9FE), (0xAA00, 0xAA28),
        (0xAA40, 0xAA42), (0xAA44, 0xAA4B), (0xAA60, 0xAA76), (0xAA7A, 0xAA7A), (0xAA7E, 0xAAAF),
        (0xAAB1, 0xAAB1), (0xAAB5, 0xAAB6), (0xAAB9, 0xAABD), (0xAAC0, 0xAAC0), (0xAAC2, 0xAAC2),
        (0xAADB, 0xAADD), (0xAAE0, 0xAAEA), (0xAAF2, 0xAAF4), (0xAB01, 0xAB06), (0xAB09, 0xAB0E),
        (0xAB11, 0xAB16), (0xAB20, 0xAB26), (0xAB28, 0xAB2E), (0xAB30, 0xAB5A), (0xAB5C, 0xAB69),
        (0xAB70, 0xABE2), (0xAC00, 0xD7A3), (0xD7B0, 0xD7C6), (0xD7CB, 0xD7FB), (0xF900, 0xFA6D),
        (0xFA70, 0xFAD9), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFB1D, 0xFB1D), (0xFB1F, 0xFB28),
        (0xFB2A, 0xFB36), (0xFB38, 0xFB3C), (0xFB3E, 0xFB3E), (0xFB40, 0xFB41), (0xFB43, 0xFB44),
        (0xFB46, 0xFBB1), (0xFBD3, 0xFD3D), (0xFD50, 0xFD8F), (0xFD92, 0xFDC7), (0xFDF0, 0xFDFB),
        (0xFE70, 0xFE74), (0xFE76, 0xFEFC), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0xFF66, 0xFFBE),
        (0xFFC2, 0xFFC7), (0xFFCA, 0xFFCF), (0xFFD2, 0xFFD7), (0xFFDA, 0xFFDC), (0x10000, 0x1000B),
        (0x1000D, 0x10026), (0x10028, 0x1003A), (0x1003C, 0x1003D), (0x1003F, 0x1004D),
        (0x10050, 0x1005D), (0x10080, 0x100FA), (0x10280, 0x1029C), (0x102A0, 0x102D0),
        (0x10300, 0x1031F), (0x1032D, 0x10340), (0x10342, 0x10349), (0x10350, 0x10375),
        (0x10380, 0x1039D), (0x103A0, 0x103C3), (0x103C8, 0x103CF), (0x10400, 0x1049D),
        (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10500, 0x10527), (0x10530, 0x10563),
        (0x10570, 0x1057A), (0x1057C, 0x1058A), (0x1058C, 0x10592), (0x10594, 0x10595),
        (0x10597, 0x105A1), (0x105A3, 0x105B1), (0x105B3, 0x105B9), (0x105BB, 0x105BC),
        (0x10600, 0x10736), (0x10740, 0x10755), (0x10760, 0x10767), (0x10780, 0x10785),
        (0x10787, 0x107B0), (0x107B2, 0x107BA), (0x10800, 0x10805), (0x10808, 0x10808),
        (0x1080A, 0x10835), (0x10837, 0x10838), (0x1083C, 0x1083C), (0x1083F, 0x10855),
        (0x10860, 0x10876), (0x10880, 0x1089E), (0x108E0, 0x108F2), (0x108F4, 0x108F5),
        (0x10900, 0x10915), (0x10920, 0x10939), (0x10980, 0x109B7), (0x109BE, 0x109BF),
        (0x10A00, 0x10A00), (0x10A10, 0x10A13), (0x10A15, 0x10A17), (0x10A19, 0x10A35),
        (0x10A60, 0x10A7C), (0x10A80, 0x10A9C), (0x10AC0, 0x10AC7), (0x10AC9, 0x10AE4),
        (0x10B00, 0x10B35), (0x10B40, 0x10B55), (0x10B60, 0x10B72), (0x10B80, 0x10B91),
        (0x10C00, 0x10C48), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x10D00, 0x10D23),
        (0x10E80, 0x10EA9), (0x10EB0, 0x10EB1), (0x10F00, 0x10F1C), (0x10F27, 0x10F27),
        (0x10F30, 0x10F45), (0x10F70, 0x10F81), (0x10FB0, 0x10FC4), (0x10FE0, 0x10FF6),
        (0x11003, 0x11037), (0x11071, 0x11072), (0x11075, 0x11075), (0x11083, 0x110AF),
        (0x110D0, 0x110E8), (0x11103, 0x11126), (0x11144, 0x11144), (0x11147, 0x11147),
        (0x11150, 0x11172), (0x11176, 0x11176), (0x11183, 0x111B2), (0x111C1, 0x111C4),
        (0x111DA, 0x111DA), (0x111DC, 0x111DC), (0x11200, 0x11211), (0x11213, 0x1122B),
        (0x1123F, 0x11240), (0x11280, 0x11286), (0x11288, 0x11288), (0x1128A, 0x1128D),
        (0x1128F, 0x1129D), (0x1129F, 0x112A8), (0x112B0, 0x112DE), (0x11305, 0x1130C),
        (0x1130F, 0x11310), (0x11313, 0x11328), (0x1132A, 0x11330), (0x11332, 0x11333),
        (0x11335, 0x11339), (0x1133D, 0x1133D), (0x11350, 0x11350), (0x1135D, 0x11361),
        (0x11400, 0x11434), (0x11447, 0x1144A), (0x1145F, 0x11461), (0x11480, 0x114AF),
        (0x114C4, 0x114C5), (0x114C7, 0x114C7), (0x11580, 0x115AE), (0x115D8, 0x115DB),
        (0x11600, 0x1162F), (0x11644, 0x11644), (0x11680, 0x116AA), (0x116B8, 0x116B8),
        (0x11700, 0x1171A), (0x11740, 0x11746), (0x11800, 0x1182B), (0x118A0, 0x118DF),
        (0x118FF, 0x11906), (0x11909, 0x11909), (0x1190C, 0x11913), (0x11915, 0x11916),
        (0x11918, 0x1192F), (0x1193F, 0x1193F), (0x11941, 0x11941), (0x119A0, 0x119A7),
        (0x119AA, 0x119D0), (0x119E1, 0x119E1), (0x119E3, 0x119E3), (0x11A00, 0x11A00),
        (0x11A0B, 0x11A32), (0x11A3A, 0x11A3A), (0x11A50, 0x11A50), (0x11A5C, 0x11A89),
        (0x11A9D, 0x11A9D), (0x11AB0, 0x11AF8), (0x11C00, 0x11C08), (0x11C0A, 0x11C2E),
        (0x11C40, 0x11C40), (0x11C72, 0x11C8F), (0x11D00, 0x11D06), (0x11D08, 0x11D09),
        (0x11D0B, 0x11D30), (0x11D46, 0x11D46), (0x11D60, 0x11D65), (0x11D67, 0x11D68),
        (0x11D6A, 0x11D89), (0x11D98, 0x11D98), (0x11EE0, 0x11EF2), (0x11F02, 0x11F02),
        (0x11F04, 0x11F10), (0x11F12, 0x11F33), (0x11FB0, 0x11FB0), (0x12000, 0x12399),
        (0x12480, 0x12543), (0x12F90, 0x12FF0), (0x13000, 0x1342F), (0x13441, 0x13446),
        (0x14400, 0x14646), (0x16800, 0x16A38), (0x16A40, 0x16A5E), (0x16A70, 0x16ABE),
        (0x16AD0, 0x16AED), (0x16B00, 0x16B2F), (0x16B40, 0x16B43), (0x16B63, 0x16B77),
        (0x16B7D, 0x16B8F), (0x16E40, 0x16E7F), (0x16F00, 0x16F4A), (0x16F50, 0x16F50),
        (0x16F93, 0x16F9F), (0x16FE0, 0x16FE1), (0x16FE3, 0x16FE3), (0x17000, 0x187F7),
        (0x18800, 0x18CD5), (0x18D00, 0x18D08), (0x1AFF0, 0x1AFF3), (0x1AFF5, 0x1AFFB),
        (0x1AFFD, 0x1AFFE), (0x1B000, 0x1B122), (0x1B132, 0x1B132), (0x1B150, 0x1B152),
        (0x1B155, 0x1B155), (0x1B164, 0x1B167), (0x1B170, 0x1B2FB), (0x1BC00, 0x1BC6A),
        (0x1BC70, 0x1BC7C), (0x1BC80, 0x1BC88), (0x1BC90, 0x1BC99), (0x1D400, 0x1D454),
        (0x1D456, 0x1D49C), (0x1D49E, 0x1D49F), (0x1D4A2, 0x1D4A2), (0x1D4A5, 0x1D4A6),
        (0x1D4A9, 0x1D4AC), (0x1D4AE, 0x1D4B9), (0x1D4BB, 0x1D4BB), (0x1D4BD, 0x1D4C3),
        (0x1D4C5, 0x1D505), (0x1D507, 0x1D50A), (0x1D50D, 0x1D514), (0x1D516, 0x1D51C),
        (0x1D51E, 0x1D539), (0x1D53B, 0x1D53E), (0x1D540, 0x1D544), (0x1D546, 0x1D546),
        (0x1D54A, 0x1D550), (0x1D552, 0x1D6A5), (0x1D6A8, 0x1D6C0), (0x1D6C2, 0x1D6DA),
        (0x1D6DC, 0x1D6FA), (0x1D6FC, 0x1D714), (0x1D716, 0x1D734), (0x1D736, 0x1D74E),
        (0x1D750, 0x1D76E), (0x1D770, 0x1D788), (0x1D78A, 0x1D7A8), (0x1D7AA, 0x1D7C2),
        (0x1D7C4, 0x1D7CB), (0x1DF00, 0x1DF1E), (0x1DF25, 0x1DF2A), (0x1E030, 0x1E06D),
        (0x1E100, 0x1E12C), (0x1E137, 0x1E13D), (0x1E14E, 0x1E14E), (0x1E290, 0x1E2AD),
        (0x1E2C0, 0x1E2EB), (0x1E4D0, 0x1E4EB), (0x1E7E0, 0x1E7E6), (0x1E7E8, 0x1E7EB),
        (0x1E7ED, 0x1E7EE), (0x1E7F0, 0x1E7FE), (0x1E800, 0x1E8C4), (0x1E900, 0x1E943),
        (0x1E94B, 0x1E94B), (0x1EE00, 0x1EE03), (0x1EE05, 0x1EE1F), (0x1EE21, 0x1EE22),
        (0x1EE24, 0x1EE24), (0x1EE27, 0x1EE27), (0x1EE29, 0x1EE32), (0x1EE34, 0x1EE37),
        (0x1EE39, 0x1EE39), (0x1EE3B, 0x1EE3B), (0x1EE42, 0x1EE42), (0x1EE47, 0x1EE47),
        (0x1EE49, 0x1EE49), (0x1EE4B, 0x1EE4B), (0x1EE4D, 0x1EE4F), (0x1EE51, 0x1EE52),
        (0x1EE54, 0x1EE54), (0x1EE57, 0x1EE57), (0x1EE59, 0x1EE59), (0x1EE5B, 0x1EE5B),
        (0x1EE5D, 0x1EE5D), (0x1EE5F, 0x1EE5F), (0x1EE61, 0x1EE62), (0x1EE64, 0x1EE64),
        (0x1EE67, 0x1EE6A), (0x1EE6C, 0x1EE72), (0x1EE74, 0x1EE77), (0x1EE79, 0x1EE7C),
        (0x1EE7E, 0x1EE7E), (0x1EE80, 0x1EE89), (0x1EE8B, 0x1EE9B), (0x1EEA1, 0x1EEA3),
        (0x1EEA5, 0x1EEA9), (0x1EEAB, 0x1EEBB), (0x20000, 0x2A6DF), (0x2A700, 0x2B739),
        (0x2B740, 0x2B81D), (0x2B820, 0x2CEA1), (0x2CEB0, 0x2EBE0), (0x2EBF0, 0x2EE5D),
        (0x2F800, 0x2FA1D), (0x30000, 0x3134A), (0x31350, 0x323AF),
    ];

    /// `\p{N}`: the code point ranges (inclusive) of general category N (Nd, Nl, No) in
    /// Unicode 15.1.
    #[rustfmt::skip]
    pub(super) const NUMBER: &[(u32, u32)] = &[
        (0x30, 0x39), (0xB2, 0xB3), (0xB9, 0xB9), (0xBC, 0xBE), (0x660, 0x669), (0x6F0, 0x6F9),
        (0x7C0, 0x7C9), (0x966, 0x96F), (0x9E6, 0x9EF), (0x9F4, 0x9F9), (0xA66, 0xA6F),
        (0xAE6, 0xAEF), (0xB66, 0xB6F), (0xB72, 0xB77), (0xBE6, 0xBF2), (0xC66, 0xC6F),
        (0xC78, 0xC7E), (0xCE6, 0xCEF), (0xD58, 0xD5E), (0xD66, 0xD78), (0xDE6, 0xDEF),
        (0xE50, 0xE59), (0xED0, 0xED9), (0xF20, 0xF33), (0x1040, 0x1049), (0x1090, 0x1099),
        (0x1369, 0x137C), (0x16EE, 0x16F0), (0x17E0, 0x17E9), (0x17F0, 0x17F9), (0x1810, 0x1819),
        (0x1946, 0x194F), (0x19D0, 0x19DA), (0x1A80, 0x1A89), (0x1A90, 0x1A99), (0x1B50, 0x1B59),
        (0x1BB0, 0x1BB9), (0x1C40, 0x1C49), (0x1C50, 0x1C59), (0x2070, 0x2070), (0x2074, 0x2079),
        (0x2080, 0x2089), (0x2150, 0x2182), (0x2185, 0x2189), (0x2460, 0x249B), (0x24EA, 0x24FF),
        (0x2776, 0x2793), (0x2CFD, 0x2CFD), (0x3007, 0x3007), (0x3021, 0x3029), (0x3038, 0x303A),
        (0x3192, 0x3195), (0x3220, 0x3229), (0x3248, 0x324F), (0x3251, 0x325F), (0x3280, 0x3289),
        (0x32B1, 0x32BF), (0xA620, 0xA629), (0xA6E6, 0xA6EF), (0xA830, 0xA835), (0xA8D0, 0xA8D9),
        (0xA900, 0xA909), (0xA9D0, 0xA9D9), (0xA9F0, 0xA9F9), (0xAA50, 0xAA59), (0xABF0, 0xABF9),
        (0xFF10, 0xFF19), (0x10107, 0x10133), (0x10140, 0x10178), (0x1018A, 0x1018B),
        (0x102E1, 0x102FB), (0x10320, 0x10323), (0x10341, 0x10341), (0x1034A, 0x1034A),
        (0x103D1, 0x103D5), (0x104A0, 0x104A9), (0x10858, 0x1085F), (0x10879, 0x1087F),
        (0x108A7, 0x108AF), (0x108FB, 0x108FF), (0x10916, 0x1091B), (0x109BC, 0x109BD),
        (0x109C0, 0x109CF), (0x109D2, 0x109FF), (0x10A40, 0x10A48), (0x10A7D, 0x10A7E),
        (0x10A9D, 0x10A9F), (0x10AEB, 0x10AEF), (0x10B58, 0x10B5F), (0x10B78, 0x10B7F),
        (0x10BA9, 0x10BAF), (0x10CFA, 0x10CFF), (0x10D30, 0x10D39), (0x10E60, 0x10E7E),
        (0x10F1D, 0x10F26), (0x10F51, 0x10F54), (0x10FC5, 0x10FCB), (0x11052, 0x1106F),
        (0x110F0, 0x110F9), (0x11136, 0x1113F), (0x111D0, 0x111D9), (0x111E1, 0x111F4),
        (0x112F0, 0x112F9), (0x11450, 0x11459), (0x114D0, 0x114D9), (0x11650, 0x11659),
        (0x116C0, 0x116C9), (0x11730, 0x1173B), (0x118E0, 0x118F2), (0x11950, 0x11959),
        (0x11C50, 0x11C6C), (0x11D50, 0x11D59), (0x11DA0, 0x11DA9), (0x11F50, 0x11F59),
        (0x11FC0, 0x11FD4), (0x12400, 0x1246E), (0x16A60, 0x16A69), (0x16AC0, 0x16AC9),
        (0x16B50, 0x16B59), (0x16B5B, 0x16B61), (0x16E80, 0x16E96), (0x1D2C0, 0x1D2D3),
        (0x1D2E0, 0x1D2F3), (0x1D360, 0x1D378), (0x1D7CE, 0x1D7FF), (0x1E140, 0x1E149),
        (0x1E2F0, 0x1E2F9), (0x1E4F0, 0x1E4F9), (0x1E8C7, 0x1E8CF), (0x1E950, 0x1E959),
        (0x1EC71, 0x1ECAB), (0x1ECAD, 0x1ECAF), (0x1ECB1, 0x1ECB4), (0x1ED01, 0x1ED2D),
        (0x1ED2F, 0x1ED3D), (0x1F100, 0x1F10C), (0x1FBF0, 0x1FBF9),
    ];
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// GPT-2 alphabet spelling of `s`.
    fn enc(s: &str) -> String {
        s.bytes().map(|b| BYTE_CHARS[usize::from(b)]).collect()
    }

    /// A small vocabulary: three control tokens, all 256 bytes, and the merges `merges`
    /// (plain text, spaces written as `_`), each adding its result as a token.
    fn tokenizer_with(merges: &[&str]) -> Tokenizer {
        let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut types = vec![3, 3, 3];
        tokens.extend(BYTE_CHARS.iter().map(|c| c.to_string()));
        types.extend([1; 256]);
        let mut merge_list = Vec::new();
        for m in merges {
            let m = m.replace('_', " ");
            let (l, r) = m.split_once('|').unwrap();
            merge_list.push(format!("{} {}", enc(l), enc(r)));
            let joined = enc(&format!("{l}{r}"));
            if !tokens.contains(&joined) {
                tokens.push(joined);
                types.push(1);
            }
        }
        Tokenizer::new(tokens, merge_list, types, Some(1), 2).unwrap()
    }

    fn small() -> Tokenizer {
        tokenizer_with(&[
            "_|t", "h|e", "_t|he", "i|n", "_|a", "e|r", "_|w", "o|r", "l|d", "_w|or", "_wor|ld",
            "H|e", "l|l", "He|ll", "Hell|o", "a|a", "'|m",
        ])
    }

    /// The pre-tokenizer's words of `text`.
    fn words(text: &str) -> Vec<&str> {
        let (mut chars, mut ranges) = (Vec::new(), Vec::new());
        pretokenize(text, &mut chars, &mut ranges);
        ranges.into_iter().map(|r| &text[r]).collect()
    }

    fn texts(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&id| String::from_utf8_lossy(tok.token_bytes(id).unwrap()).into_owned())
            .collect()
    }

    #[test]
    fn byte_alphabet_is_gpt2s() {
        assert_eq!(BYTE_CHARS[usize::from(b' ')], 'Ġ');
        assert_eq!(BYTE_CHARS[usize::from(b'\n')], 'Ċ');
        assert_eq!(BYTE_CHARS[usize::from(b'a')], 'a');
        assert_eq!(BYTE_CHARS[0], '\u{100}');
        assert_eq!(BYTE_CHARS[0xAD], '\u{143}');
        for b in 0..=255u8 {
            assert_eq!(char_byte(BYTE_CHARS[usize::from(b)]), Some(b));
        }
        assert_eq!(char_byte('\u{144}'), None);
        assert_eq!(char_byte('€'), None);
    }

    #[test]
    fn character_classes_are_unicode_15_1_categories() {
        assert_eq!(classify('é'), Class::Letter);
        assert_eq!(classify('中'), Class::Letter);
        assert_eq!(classify('ß'), Class::Letter);
        // A combining vowel sign is alphabetic but not a letter (category Mc).
        assert!('\u{93E}'.is_alphabetic());
        assert_eq!(classify('\u{93E}'), Class::Other);
        assert_eq!(classify('²'), Class::Number);
        assert_eq!(classify('Ⅻ'), Class::Number);
        assert_eq!(classify('٣'), Class::Number);
        assert_eq!(classify('\u{3000}'), Class::Space);
        assert_eq!(classify('\u{85}'), Class::Space);
        // Information separators are whitespace to Python's str.isspace, not White_Space.
        assert_eq!(classify('\u{1C}'), Class::Other);
        assert_eq!(classify('😀'), Class::Other);
        // CJK Extension I (Unicode 15.1) is a letter; Garay (Unicode 16) is not yet.
        assert_eq!(classify('\u{2EBF0}'), Class::Letter);
        assert_eq!(classify('\u{10D4A}'), Class::Other);
    }

    #[test]
    fn tables_are_sorted_and_disjoint() {
        for table in [unicode::LETTER, unicode::NUMBER] {
            for w in table.windows(2) {
                assert!(w[0].0 <= w[0].1 && w[0].1 < w[1].0, "{w:x?}");
            }
        }
    }

    #[test]
    fn pretokenizer_follows_the_gpt2_rule() {
        assert_eq!(words("Hello world"), ["Hello", " world"]);
        assert_eq!(
            words("I'm here, they'll see"),
            ["I", "'m", " here", ",", " they", "'ll", " see"]
        );
        assert_eq!(words("DON'T"), ["DON", "'", "T"]);
        assert_eq!(words("a   b"), ["a", "  ", " b"]);
        assert_eq!(words("a  "), ["a", "  "]);
        assert_eq!(words("x\n\ny"), ["x", "\n", "\n", "y"]);
        assert_eq!(words("  \n  hi"), ["  \n ", " hi"]);
        assert_eq!(words("wow!!! ?? ok"), ["wow", "!!!", " ??", " ok"]);
        assert_eq!(words("fn(x) {}"), ["fn", "(", "x", ")", " {}"]);
        assert_eq!(words("naïve café"), ["naïve", " café"]);
        assert_eq!(words("日本語のテキスト"), ["日本語のテキスト"]);
        assert_eq!(words("🙂 ok"), ["🙂", " ok"]);
        assert_eq!(words(""), Vec::<&str>::new());
        assert_eq!(words("'"), ["'"]);
        assert_eq!(words("'s"), ["'s"]);
    }

    #[test]
    fn pretokenizer_isolates_every_digit() {
        assert_eq!(words("12345"), ["1", "2", "3", "4", "5"]);
        // The space before a digit is cut off from it by the first pass.
        assert_eq!(
            words("in 2024, x2"),
            ["in", " ", "2", "0", "2", "4", ",", " x", "2"]
        );
        assert_eq!(words("3.14"), ["3", ".", "1", "4"]);
        assert_eq!(words("x²"), ["x", "²"]);
        // A run of spaces before a digit ends the piece, so it is kept whole.
        assert_eq!(words("a   1"), ["a", "   ", "1"]);
    }

    #[test]
    fn pretokenizer_covers_the_text() {
        let text = "Mixed: 'quotes', \t tabs\r\n 42 ½ — done  ";
        assert_eq!(words(text).concat(), text);
    }

    #[test]
    fn merges_apply_by_rank() {
        let tok = small();
        let ids = tok.encode("Hello world the", false);
        assert_eq!(texts(&tok, &ids), ["Hello", " world", " the"]);
        // On equal ranks the leftmost pair merges first.
        let ids = tok.encode("aaa", false);
        assert_eq!(texts(&tok, &ids), ["aa", "a"]);
        assert_eq!(texts(&tok, &tok.encode("I'm", false)), ["I", "'m"]);
    }

    #[test]
    fn lower_rank_wins_over_position() {
        // "b c" ranks before "a b": "abc" -> "a", "bc".
        let tok = tokenizer_with(&["b|c", "a|b"]);
        assert_eq!(texts(&tok, &tok.encode("abc", false)), ["a", "bc"]);
        let tok = tokenizer_with(&["a|b", "b|c"]);
        assert_eq!(texts(&tok, &tok.encode("abc", false)), ["ab", "c"]);
    }

    #[test]
    fn control_tokens_only_on_request() {
        let tok = small();
        let text = "<|im_start|>user\nhi<|im_end|>";
        let ids = tok.encode(text, true);
        assert_eq!(ids[0], 1);
        assert_eq!(*ids.last().unwrap(), 2);
        assert_eq!(tok.decode(&ids), text.as_bytes());
        let plain = tok.encode(text, false);
        assert!(plain.iter().all(|&id| !tok.is_special(id)), "{plain:?}");
        assert_eq!(tok.decode(&plain), text.as_bytes());
        assert_eq!(tok.id_of("<|im_end|>"), Some(2));
        assert_eq!(tok.id_of("hi"), None);
        assert_eq!(tok.id_of(""), None);
    }

    #[test]
    fn longer_added_tokens_are_cut_first() {
        let mut tokens: Vec<String> = BYTE_CHARS.iter().map(|c| c.to_string()).collect();
        let mut types = vec![1; 256];
        tokens.extend(["<a>".to_string(), "<a><b>".to_string(), "<b>".to_string()]);
        types.extend([3, 3, 4]);
        let tok = Tokenizer::new(tokens, Vec::new(), types, None, 256).unwrap();
        assert_eq!(tok.encode("x<a><b><a>y", true), [120, 257, 256, 121]);
        // User-defined tokens are cut out even without parse_special.
        let ids = tok.encode("<a><b>", false);
        assert_eq!(*ids.last().unwrap(), 258);
        assert_eq!(ids.len(), 4);
        assert_eq!(tok.decode(&ids), b"<a><b>");
    }

    #[test]
    fn decodes_partial_utf8_per_token() {
        let tok = small();
        let ids = tok.encode("é", false);
        assert_eq!(ids.len(), 2);
        assert_eq!(tok.token_bytes(ids[0]), Some(&[0xC3][..]));
        assert_eq!(tok.decode(&ids), "é".as_bytes());
        assert_eq!(tok.token_bytes(u32::MAX), None);
        assert_eq!(tok.decode(&[u32::MAX, ids[0], ids[1]]), "é".as_bytes());
        assert_eq!(tok.token_bytes(0), Some(&b"<|endoftext|>"[..]));
    }

    #[test]
    fn bytes_without_a_token_are_dropped() {
        let tokens: Vec<String> = ('a'..='z').map(|c| c.to_string()).collect();
        let types = vec![1; tokens.len()];
        let tok = Tokenizer::new(tokens, vec!["a b".into()], types, None, 0).unwrap();
        assert_eq!(tok.encode("a\u{4}b", false), [0, 1]);
        assert_eq!(tok.encode("\u{4}", false), Vec::<u32>::new());
    }

    #[test]
    fn merge_results_missing_from_the_vocabulary_fall_back_to_bytes() {
        let mut tokens: Vec<String> = BYTE_CHARS.iter().map(|c| c.to_string()).collect();
        tokens.push("xy".into());
        let types = vec![1; tokens.len()];
        // "x y" makes "xy"; "xy z" makes "xyz", which is no token.
        let merges = vec!["x y".to_string(), "xy z".to_string()];
        let tok = Tokenizer::new(tokens, merges, types, None, 0).unwrap();
        assert_eq!(tok.encode("xy", false), [256]);
        assert_eq!(tok.encode("xyz", false), [120, 121, 122]);
    }

    #[test]
    fn constructor_checks_its_input() {
        let t = |n: usize| -> Vec<String> { (0..n).map(|i| format!("t{i}")).collect() };
        assert!(matches!(
            Tokenizer::new(Vec::new(), Vec::new(), Vec::new(), None, 0),
            Err(TokenizerError::EmptyVocabulary)
        ));
        assert!(matches!(
            Tokenizer::new(t(2), Vec::new(), vec![1], None, 0),
            Err(TokenizerError::TypeCountMismatch {
                tokens: 2,
                token_types: 1
            })
        ));
        assert!(matches!(
            Tokenizer::new(t(2), vec!["nospace".into()], vec![1, 1], None, 0),
            Err(TokenizerError::MalformedMerge { index: 0, .. })
        ));
        assert!(matches!(
            Tokenizer::new(t(2), vec![" x".into()], vec![1, 1], None, 0),
            Err(TokenizerError::MalformedMerge { index: 0, .. })
        ));
        assert!(matches!(
            Tokenizer::new(t(2), Vec::new(), vec![1, 1], None, 2),
            Err(TokenizerError::TokenOutOfRange {
                which: "EOS",
                id: 2,
                vocab_size: 2
            })
        ));
        assert!(matches!(
            Tokenizer::new(t(2), Vec::new(), vec![1, 1], Some(7), 1),
            Err(TokenizerError::TokenOutOfRange {
                which: "BOS",
                id: 7,
                ..
            })
        ));
        let tok = Tokenizer::new(t(2), vec!["é x".into()], vec![1, 9], Some(0), 1).unwrap();
        assert_eq!(tok.token_type(1), Some(TokenType::Undefined));
        assert_eq!(tok.vocab_size(), 2);
        assert_eq!((tok.bos(), tok.eos()), (Some(0), 1));
    }

    /// Reference BPE: repeatedly merge the leftmost pair of lowest rank.
    fn naive_bpe(tok: &Tokenizer, word: &[u8]) -> Vec<usize> {
        let mut syms: Vec<usize> = word
            .iter()
            .map(|&b| tok.byte_piece[usize::from(b)])
            .collect();
        loop {
            let best = (0..syms.len().saturating_sub(1))
                .filter_map(|i| {
                    tok.merges
                        .get(&(syms[i], syms[i + 1]))
                        .map(|m| (m.rank, i, m.piece))
                })
                .min();
            let Some((_, i, piece)) = best else {
                return syms;
            };
            syms[i] = piece;
            syms.remove(i + 1);
        }
    }

    fn text_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[ a-z'!?.,\n\t0-9]{0,60}",
            "(Hello|world|the|in| |  |aa|a|'m|'s|<\\|im_end\\|>|é|中|😀|\u{85}|\u{3000}|1|²){0,20}",
        ]
    }

    proptest! {
        #[test]
        fn round_trips_any_text(text in text_strategy()) {
            let tok = small();
            prop_assert_eq!(tok.decode(&tok.encode(&text, false)), text.as_bytes());
            prop_assert_eq!(tok.decode(&tok.encode(&text, true)), text.as_bytes());
        }

        #[test]
        fn words_cover_the_text(text in text_strategy()) {
            prop_assert_eq!(words(&text).concat(), text);
        }

        #[test]
        fn queue_bpe_matches_naive_bpe(text in "(Hello|world|the|in| |aa|a|b|'m|x){0,30}") {
            let tok = small();
            for word in words(&text) {
                let mut scratch = Scratch::default();
                let mut out = Vec::new();
                tok.merge_word(word.as_bytes(), &mut scratch, &mut out);
                let naive: Vec<u32> = naive_bpe(&tok, word.as_bytes())
                    .into_iter()
                    .map(|p| u32::try_from(p).unwrap())
                    .collect();
                prop_assert_eq!(out, naive);
            }
        }
    }
}
