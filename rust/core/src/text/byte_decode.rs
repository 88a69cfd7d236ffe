//! Table-driven decoding for byte-level BPE tokenizers (GPT-2 style: SmolLM2, Qwen, Llama 3).
//!
//! When a tokenizer's decoder is exactly `ByteLevel`, the `tokenizers` library decodes ids by looking up each
//! kept token's text, mapping it back to bytes (its GPT-2 byte-to-unicode alphabet, or the raw UTF-8 of a
//! token that is not spelled in that alphabet, such as an added token), concatenating the bytes, and reading
//! them as UTF-8 with U+FFFD for invalid sequences. Each token is mapped independently, so the bytes can be
//! computed once per id. Decoding from that table gives the same string without the library's per-token
//! `String` allocations, which were most of a decode tick's host time (the text stream decodes a short window
//! twice per generated token, for every row of the batch).

use tokenizers::DecoderWrapper;

/// Every token's bytes, and whether `skip_special_tokens` drops it.
pub struct ByteTable {
    /// Token `id`'s bytes are `bytes[offsets[id]..offsets[id + 1]]`; ids without a token have none.
    bytes: Vec<u8>,
    offsets: Vec<u32>,
    /// The library drops a token when skipping special tokens if its text is a special token's text.
    special: Vec<bool>,
}

impl ByteTable {
    /// The table for `inner` when its decoder is exactly `ByteLevel` (anything else decodes through the
    /// library); `vocab_size` is one past the largest id.
    pub fn build(inner: &tokenizers::Tokenizer, vocab_size: usize) -> Option<Self> {
        if !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let char_bytes = gpt2_char_bytes();
        let added = inner.get_added_vocabulary();
        let mut table = ByteTable { bytes: Vec::new(), offsets: Vec::with_capacity(vocab_size + 1), special: vec![false; vocab_size] };
        table.offsets.push(0);
        for id in 0..vocab_size {
            // Same lookup as the library's decode: added tokens first, then the model's vocabulary.
            if let Some(token) = inner.id_to_token(id as u32) {
                table.special[id] = added.is_special_token(&token);
                match token.chars().map(|c| char_bytes.get(c as usize).copied().flatten()).collect::<Option<Vec<u8>>>() {
                    Some(bytes) => table.bytes.extend_from_slice(&bytes),
                    None => table.bytes.extend_from_slice(token.as_bytes()),
                }
            }
            table.offsets.push(u32::try_from(table.bytes.len()).ok()?);
        }
        Some(table)
    }

    /// Appends the text of `ids`, exactly as the library's `decode` gives it, to `out`. Ids are checked by
    /// the caller.
    pub fn decode_into(&self, ids: &[u32], skip_special_tokens: bool, out: &mut String) {
        // Bytes go straight into `out`'s buffer; valid UTF-8 (the usual case) needs no second copy.
        let mut bytes = std::mem::take(out).into_bytes();
        let start = bytes.len();
        self.push_bytes(ids, skip_special_tokens, &mut bytes);
        *out = text_of(bytes, start);
    }

    /// [`decode_into`](Self::decode_into) of `ids`, also returning the length of the text that `ids[..split]`
    /// decodes to on its own: both decodes of an incremental detokenizer's window, with one pass over the table.
    pub fn decode_window_into(&self, ids: &[u32], split: usize, skip_special_tokens: bool, out: &mut String) -> usize {
        let mut bytes = std::mem::take(out).into_bytes();
        let start = bytes.len();
        self.push_bytes(&ids[..split], skip_special_tokens, &mut bytes);
        let split_at = bytes.len();
        self.push_bytes(&ids[split..], skip_special_tokens, &mut bytes);
        match String::from_utf8(bytes) {
            // Valid text cut at a character boundary: the prefix's bytes are valid on their own (the usual case,
            // settled by the one validation of the whole window).
            Ok(text) if text.is_char_boundary(split_at) => {
                *out = text;
                split_at - start
            }
            invalid_or_split => {
                let bytes = invalid_or_split.map_or_else(|e| e.into_bytes(), String::into_bytes);
                let prefix_len = String::from_utf8_lossy(&bytes[start..split_at]).len();
                *out = text_of(bytes, start);
                prefix_len
            }
        }
    }

    /// Token `id`'s bytes as text when they are complete UTF-8 on their own, not empty, do not end in U+FFFD and
    /// are not dropped by `skip_special_tokens` (the library's decode of any valid text followed by the token
    /// then appends exactly them); None otherwise and for ids outside the table.
    pub fn standalone_text(&self, id: u32, skip_special_tokens: bool) -> Option<&str> {
        if id as usize >= self.special.len() || (skip_special_tokens && self.special[id as usize]) {
            return None;
        }
        let text = std::str::from_utf8(self.token_bytes(id)).ok()?;
        (!text.is_empty() && !text.ends_with('\u{FFFD}')).then_some(text)
    }

    /// Token `id`'s own bytes (checked by the caller), which may be part of a UTF-8 character.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        &self.bytes[self.offsets[id as usize] as usize..self.offsets[id as usize + 1] as usize]
    }

    fn push_bytes(&self, ids: &[u32], skip_special_tokens: bool, bytes: &mut Vec<u8>) {
        for &id in ids {
            if !(skip_special_tokens && self.special[id as usize]) {
                bytes.extend_from_slice(self.token_bytes(id));
            }
        }
    }
}

/// `bytes` as text: the bytes before `start` are a String's, the new ones are read as the library reads them.
fn text_of(bytes: Vec<u8>, start: usize) -> String {
    match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            // A split character: U+FFFD for the invalid sequences of the new bytes, as the library does.
            let mut bytes = e.into_bytes();
            let lossy = String::from_utf8_lossy(&bytes[start..]).into_owned();
            bytes.truncate(start);
            let mut text = String::from_utf8(bytes).expect("the bytes before `start` were a String");
            text.push_str(&lossy);
            text
        }
    }
}

/// The inverse of GPT-2's byte-to-unicode map, indexed by char: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes for U+0100.. in byte order (as in the library's `bytes_char`).
fn gpt2_char_bytes() -> Vec<Option<u8>> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = vec![None; 0x100 + 256];
    let mut next = 0x100;
    for b in 0..=255u8 {
        if printable(b) {
            map[b as usize] = Some(b);
        } else {
            map[next] = Some(b);
            next += 1;
        }
    }
    map
}
