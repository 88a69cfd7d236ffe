//! Incremental detokenization and stop strings, run once per generated token.
//!
//! Decoding all ids every step would cost O(n) per token, and decoding each id alone is wrong (a character
//! may span tokens, and some decoders treat the first token specially). So, as in vLLM and TGI, each step
//! decodes only a short window: ids from `prefix_offset` (context already emitted) to the end, and emits
//! what that window adds beyond the text of `prefix_offset..read_offset`.

use crate::error::{protocol, Result};
use crate::text::tokenizer::Tokenizer;

/// What one generated token made safe to show.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamStep {
    /// Text newly safe to emit (never part of a possible stop string, never a partial character).
    pub text: String,
    /// The stop string that just completed; the stream is finished once this is set.
    pub stopped: Option<String>,
}

/// Per-sequence detokenizer with stop-string matching across token boundaries.
#[derive(Debug, Clone)]
pub struct TextStream {
    stops: Vec<String>,
    skip_special_tokens: bool,
    /// Keep the stop string at the end of the text (vLLM's include_stop_str_in_output).
    include_stop: bool,
    /// Stop strings that end within the text of the first `min_tokens` ids do not count (vLLM's min_tokens).
    min_tokens: usize,
    /// Byte length of the text of the first `min_tokens` ids, once they are all decoded: a stop counts only if
    /// it ends past this. Until then every stop is ignored.
    stops_end_past: Option<usize>,
    ids: Vec<u32>,
    /// Start of the decode window: ids before it are never decoded again.
    prefix_offset: usize,
    /// Ids before this have had their text appended to `decoded`.
    read_offset: usize,
    /// All complete text decoded so far; `decoded[..emitted_len]` has been emitted.
    decoded: String,
    emitted_len: usize,
    stopped: Option<String>,
    flushed: bool,
    /// Lossy text of a trailing incomplete character, released only by `flush`.
    incomplete_tail: String,
    /// Where each step decodes its window; kept so that a step allocates nothing for decoding.
    window: String,
}

/// Where the text that a step's new ids add lies in `TextStream::window`.
struct AddedText {
    start: usize,
    /// False while the text ends in an incomplete UTF-8 sequence (decoded as U+FFFD).
    is_complete: bool,
}

impl TextStream {
    /// Empty stop strings are ignored: they would match before any text.
    pub fn new(stops: Vec<String>, skip_special_tokens: bool) -> Self {
        Self::with_options(stops, skip_special_tokens, false, 0)
    }

    /// [`new`](Self::new) with vLLM's `include_stop_str_in_output` and `min_tokens`.
    pub fn with_options(stops: Vec<String>, skip_special_tokens: bool, include_stop: bool, min_tokens: usize) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            skip_special_tokens,
            include_stop,
            min_tokens,
            stops_end_past: (min_tokens == 0).then_some(0),
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            decoded: String::new(),
            emitted_len: 0,
            stopped: None,
            flushed: false,
            incomplete_tail: String::new(),
            window: String::new(),
        }
    }

    /// Feeds one generated token; returns the text it made safe and whether a stop string completed.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<StreamStep> {
        let mut text = String::new();
        let stopped = self.push_to(tok, id, &mut text)?;
        Ok(StreamStep { text, stopped })
    }

    /// [`push`](Self::push) that appends the text it made safe to `out` instead of returning a new String
    /// (the stepper calls this for every row on every decode tick). Returns the stop string that completed.
    pub fn push_to(&mut self, tok: &Tokenizer, id: u32, out: &mut String) -> Result<Option<String>> {
        if let Some(stop) = &self.stopped {
            return protocol(format!("text stream already stopped at {stop:?}; no more tokens may be pushed"));
        }
        if self.flushed {
            return protocol("text stream was flushed (finished); no more tokens may be pushed");
        }
        self.ids.push(id);
        let added = self.decode_new_tokens(tok)?;
        let text = &self.window[added.start..];
        if added.is_complete {
            self.incomplete_tail.clear();
            if !text.is_empty() {
                self.decoded.push_str(text);
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
            }
        } else {
            // Keep the lossy text so a finish mid-character still yields what decode(all ids) would.
            self.incomplete_tail.clear();
            self.incomplete_tail.push_str(text);
        }
        if self.stops_end_past.is_none() && self.ids.len() >= self.min_tokens {
            // A character still incomplete here is finished by a later token, so its text counts as theirs.
            self.stops_end_past = Some(self.decoded.len());
        }
        Ok(self.release(out))
    }

    /// Releases everything held back (a partial stop string, a trailing incomplete character) at a finish
    /// that was not a stop. The stream accepts no tokens afterwards.
    pub fn flush(&mut self) -> String {
        if self.stopped.is_some() || self.flushed {
            return String::new();
        }
        self.flushed = true;
        let tail = std::mem::take(&mut self.incomplete_tail);
        self.decoded.push_str(&tail);
        let out = self.decoded[self.emitted_len..].to_string();
        self.emitted_len = self.decoded.len();
        out
    }

    /// All text emitted so far (the concatenation of every step's `text`, plus `flush`).
    pub fn text(&self) -> &str {
        &self.decoded[..self.emitted_len]
    }

    /// The stop string that ended this stream, if any.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// Decodes the window into `self.window` and finds the text that the ids since `read_offset` add to it.
    fn decode_new_tokens(&mut self, tok: &Tokenizer) -> Result<AddedText> {
        self.window.clear();
        // The usual step: every id before the new one has its text in `decoded` (complete), and the new id's text
        // is complete on its own, so the window's decode would add exactly that text (byte-level tokenizers).
        if self.read_offset + 1 == self.ids.len() {
            if let Some(text) = tok.standalone_text(self.ids[self.read_offset], self.skip_special_tokens) {
                self.window.push_str(text);
                return Ok(AddedText { start: 0, is_complete: true });
            }
        }
        let split = self.read_offset - self.prefix_offset;
        let prefix_len = tok.decode_window_into(&self.ids[self.prefix_offset..], split, self.skip_special_tokens, &mut self.window)?;
        // The window's text extends the prefix's for byte-level decoders; slicing by length (as vLLM does)
        // also tolerates decoders that rewrite the start of a window. Nothing new (e.g. a skipped special
        // token) leaves the offsets where they are.
        let full = &self.window;
        let start = if full.len() > prefix_len && full.is_char_boundary(prefix_len) { prefix_len } else { full.len() };
        // U+FFFD at the end means the last token stopped mid-character: wait for the rest of it.
        Ok(AddedText { start, is_complete: !full[start..].ends_with('\u{FFFD}') })
    }

    /// Appends to `out` what can no longer become part of a stop string, or cuts at a stop that just completed
    /// and returns it.
    fn release(&mut self, out: &mut String) -> Option<String> {
        let pending = &self.decoded[self.emitted_len..];
        let counted = self.stops_end_past.map(|end| end.saturating_sub(self.emitted_len));
        if let Some((at, stop)) = counted.and_then(|past| earliest_stop_ending_past(pending, &self.stops, past)) {
            let stop_start = self.emitted_len + at;
            let text_end = if self.include_stop { stop_start + stop.len() } else { stop_start };
            out.push_str(&self.decoded[self.emitted_len..text_end]);
            self.decoded.truncate(text_end);
            self.emitted_len = text_end;
            self.stopped = Some(stop.to_string());
            return self.stopped.clone();
        }
        let hold = longest_stop_prefix_suffix(pending, &self.stops);
        let safe_end = self.decoded.len() - hold;
        out.push_str(&self.decoded[self.emitted_len..safe_end]);
        self.emitted_len = safe_end;
        None
    }
}

/// Cuts a finished text at its earliest stop string (the stop is not included). Ties at the same
/// position go to the shortest stop, the one a stream would have completed first. Applied to the text
/// generated up to the token where a `TextStream` stopped, it agrees with that stream: the stream ends at
/// the first stop to complete, so a longer stop that began earlier but was never finished is not in the text.
pub fn truncate_at_stop(text: &str, stops: &[String]) -> (String, Option<String>) {
    match earliest_stop(text, stops) {
        Some((at, stop)) => (text[..at].to_string(), Some(stop.to_string())),
        None => (text.to_string(), None),
    }
}

/// Byte position and text of the earliest stop occurrence in `text` (shortest stop on ties).
fn earliest_stop<'s>(text: &str, stops: &'s [String]) -> Option<(usize, &'s str)> {
    earliest_stop_ending_past(text, stops, 0)
}

/// [`earliest_stop`] among the occurrences that end past byte `past` of `text` (those ending earlier lie in
/// text where stops do not count).
fn earliest_stop_ending_past<'s>(text: &str, stops: &'s [String], past: usize) -> Option<(usize, &'s str)> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let from = first_char_boundary_from(text, (past + 1).saturating_sub(s.len()));
            find_stop(&text[from..], s).map(|at| (from + at, s.as_str()))
        })
        .min_by_key(|&(at, s)| (at, s.len()))
}

/// The first character boundary of `text` at or after byte `at` (`text.len()` past the end): a stop string
/// starts on one.
fn first_char_boundary_from(text: &str, at: usize) -> usize {
    (at..text.len()).find(|&i| text.is_char_boundary(i)).unwrap_or(text.len())
}

/// Longest text searched by a plain scan; a stream's pending text (a held-back stop prefix and one token's
/// text) is almost always shorter.
const SHORT_TEXT: usize = 64;

/// `text.find(stop)` for a non-empty stop. Every row searches its pending text for every stop on every decode
/// tick, and for a few bytes `str::find`'s searcher costs more to set up than a plain scan takes. A byte match
/// of a whole UTF-8 string always starts at a character boundary, so both give the same position.
fn find_stop(text: &str, stop: &str) -> Option<usize> {
    if text.len() > SHORT_TEXT {
        return text.find(stop);
    }
    let (text, stop) = (text.as_bytes(), stop.as_bytes());
    let last_start = text.len().checked_sub(stop.len())?;
    (0..=last_start).find(|&at| text[at] == stop[0] && text[at..].starts_with(stop))
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of some stop string: text that
/// the next tokens could still turn into a stop, so it must not be emitted yet.
fn longest_stop_prefix_suffix(text: &str, stops: &[String]) -> usize {
    let Some(&last) = text.as_bytes().last() else { return 0 };
    stops
        .iter()
        .filter_map(|stop| {
            let longest = (stop.len() - 1).min(text.len());
            // Comparing the last byte first skips a full comparison for almost every candidate length.
            (1..=longest)
                .rev()
                .find(|&n| stop.as_bytes()[n - 1] == last && stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn truncate_at_stop_takes_the_earliest_occurrence() {
        let s = stops(&["world", "lo"]);
        assert_eq!(truncate_at_stop("hello world", &s), ("hel".to_string(), Some("lo".to_string())));
        assert_eq!(truncate_at_stop("no match", &s), ("no match".to_string(), None));
        assert_eq!(truncate_at_stop("abc", &stops(&["abc", "ab"])), ("".to_string(), Some("ab".to_string())));
        assert_eq!(truncate_at_stop("abc", &stops(&[""])), ("abc".to_string(), None));
    }

    #[test]
    fn find_stop_agrees_with_str_find() {
        let long = "x".repeat(SHORT_TEXT) + "é</end>";
        for text in ["", "a", "</end", "</end>", "ab</end>cd</end>", "éé</end>", "a é", "ééé", long.as_str()] {
            for stop in ["</end>", "é", "a", "éa", "d", "</end></end></end>"] {
                assert_eq!(find_stop(text, stop), text.find(stop), "{text:?} {stop:?}");
            }
        }
    }

    #[test]
    fn held_suffix_is_the_longest_stop_prefix() {
        let s = stops(&["</end>", "xyz"]);
        assert_eq!(longest_stop_prefix_suffix("text </e", &s), 3);
        assert_eq!(longest_stop_prefix_suffix("text <", &s), 1);
        assert_eq!(longest_stop_prefix_suffix("textxy", &s), 2);
        assert_eq!(longest_stop_prefix_suffix("text", &s), 0);
        // A multi-byte stop is only held at character boundaries.
        assert_eq!(longest_stop_prefix_suffix("a é", &stops(&["éa"])), 2);
    }
}
