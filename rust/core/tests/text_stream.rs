//! Incremental detokenization and stop strings over the fixture's byte-level BPE tokenizer (whose small
//! vocabulary splits multi-byte characters such as emoji into several tokens).

use std::path::PathBuf;

use stepllm_core::text::{truncate_at_stop, StreamStep, TextStream, Tokenizer};
use stepllm_core::Error;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama").join(name)
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(&fixture("tokenizer.json")).unwrap()
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Streams `ids`, checking after every step what must always hold: emitted text is a prefix of the final
/// answer (so nothing emitted is ever taken back by a later stop), contains no stop string and never ends
/// in a partial character.
fn stream(tok: &Tokenizer, ids: &[u32], stops: &[&str], skip_special: bool) -> (Vec<StreamStep>, TextStream) {
    let stops = strings(stops);
    let (final_text, _) = truncate_at_stop(&tok.decode(ids, skip_special).unwrap(), &stops);
    let mut s = TextStream::new(stops.clone(), skip_special);
    let mut steps = Vec::new();
    for &id in ids {
        let step = s.push(tok, id).unwrap();
        let done = step.stopped.is_some();
        steps.push(step);
        assert!(final_text.starts_with(s.text()), "emitted {:?} is not a prefix of {final_text:?}", s.text());
        assert!(!s.text().ends_with('\u{FFFD}'), "emitted a partial character: {:?}", s.text());
        assert!(stops.iter().all(|stop| !s.text().contains(stop.as_str())), "emitted a stop: {:?}", s.text());
        if done {
            break;
        }
    }
    (steps, s)
}

fn concatenated(steps: &[StreamStep]) -> String {
    steps.iter().map(|s| s.text.as_str()).collect()
}

#[test]
fn without_stops_the_stream_reassembles_decode_of_all_ids() {
    let tok = tokenizer();
    let texts = [
        "The capital of France is Paris.",
        "naïve café 東京 🙂 — numbers 0123456789 and symbols !@#$%^&*()",
        "🙂🙂 東京東京 ééé",
        "<|im_start|>assistant\nHello<|im_end|>",
    ];
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        for skip in [false, true] {
            let (steps, mut s) = stream(&tok, &ids, &[], skip);
            let flushed = s.flush();
            assert_eq!(concatenated(&steps) + &flushed, tok.decode(&ids, skip).unwrap(), "{text:?}");
            assert_eq!(s.text(), tok.decode(&ids, skip).unwrap());
            assert!(steps.iter().all(|st| st.stopped.is_none()));
        }
    }
}

#[test]
fn invalid_utf8_output_streams_to_the_same_lossy_text_as_transformers() {
    // Random-weight greedy output from expected.json: mostly partial UTF-8, some of it at the very end.
    let tok = tokenizer();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    for row in expected["rows"].as_array().unwrap() {
        let ids: Vec<u32> = row["greedy_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let (steps, mut s) = stream(&tok, &ids, &[], false);
        let all = concatenated(&steps) + &s.flush();
        assert_eq!(all, row["greedy_text"].as_str().unwrap());
    }
}

#[test]
fn emoji_split_across_tokens_is_emitted_whole() {
    let tok = tokenizer();
    let ids = tok.encode("a🙂b", false).unwrap();
    assert!(ids.len() >= 4, "the fixture vocabulary should split the emoji into bytes: {ids:?}");
    let (steps, _) = stream(&tok, &ids, &[], false);
    let pieces: Vec<&str> = steps.iter().map(|s| s.text.as_str()).filter(|t| !t.is_empty()).collect();
    assert_eq!(pieces, ["a", "🙂", "b"]);
}

#[test]
fn stop_spanning_token_boundaries_is_held_back_then_cut() {
    let tok = tokenizer();
    let ids = tok.encode("Hello, world! How are you today?", false).unwrap();
    let (steps, s) = stream(&tok, &ids, &["world! How"], false);
    let last = steps.last().unwrap();
    assert_eq!(last.stopped.as_deref(), Some("world! How"));
    assert_eq!(s.text(), "Hello, ");
    assert_eq!(s.stopped(), Some("world! How"));
    assert!(steps.len() < ids.len(), "the stream should end at the stop, before the remaining tokens");
}

#[test]
fn held_back_text_is_released_when_it_stops_matching() {
    let tok = tokenizer();
    let ids = tok.encode("The capital of France is Paris.", false).unwrap();
    let (steps, mut s) = stream(&tok, &ids, &["is Rome"], false);
    // "is" could begin "is Rome", so the step that decodes " is" emits only the space; the next token
    // shows it is "is P..." and releases it.
    let is_token = ids.iter().position(|&id| tok.decode(&[id], false).unwrap() == " is").unwrap();
    assert_eq!(steps[is_token].text, " ");
    assert!(steps[is_token + 1].text.starts_with("is P"), "{:?}", steps[is_token + 1]);
    assert_eq!(concatenated(&steps) + &s.flush(), "The capital of France is Paris.");
}

#[test]
fn a_partial_stop_at_the_end_is_released_by_flush() {
    let tok = tokenizer();
    let ids = tok.encode("Hello, world", false).unwrap();
    let (steps, mut s) = stream(&tok, &ids, &["world peace"], false);
    assert_eq!(concatenated(&steps), "Hello, ");
    assert_eq!(s.flush(), "world");
    assert_eq!(s.text(), "Hello, world");
    assert_eq!(s.flush(), "", "a second flush has nothing left");
}

#[test]
fn stop_inside_a_single_token() {
    let tok = tokenizer();
    let capital = tok.encode(" capital", false).unwrap();
    assert_eq!(capital.len(), 1, "the fixture has \" capital\" as one token");
    let ids = tok.encode("The capital of France", false).unwrap();
    let (steps, s) = stream(&tok, &ids, &["pit"], false);
    assert_eq!(s.text(), "The ca");
    assert_eq!(steps.last().unwrap().stopped.as_deref(), Some("pit"));
}

#[test]
fn with_several_stops_the_earliest_wins() {
    let tok = tokenizer();
    let ids = tok.encode("The capital of France is Paris. The capital of Italy is Rome.", false).unwrap();
    let (_, s) = stream(&tok, &ids, &["Rome", "Paris", "xyz"], false);
    assert_eq!(s.text(), "The capital of France is ");
    assert_eq!(s.stopped(), Some("Paris"));
    let (_, s) = stream(&tok, &ids, &["Italy", "Rome"], false);
    assert_eq!(s.text(), "The capital of France is Paris. The capital of ");
    assert_eq!(s.stopped(), Some("Italy"));
}

#[test]
fn multibyte_stop_across_byte_tokens() {
    let tok = tokenizer();
    let ids = tok.encode("naïve café 東京 🙂 — numbers", false).unwrap();
    let (_, s) = stream(&tok, &ids, &["🙂"], false);
    assert_eq!(s.text(), "naïve café 東京 ");
    let (_, s) = stream(&tok, &ids, &["京 🙂 —"], false);
    assert_eq!(s.text(), "naïve café 東");
}

#[test]
fn special_tokens_are_skipped_or_matched_as_stops() {
    let tok = tokenizer();
    let ids = tok.encode("Hello<|im_end|>world", false).unwrap();
    let (steps, mut s) = stream(&tok, &ids, &[], true);
    assert_eq!(concatenated(&steps) + &s.flush(), "Helloworld");
    let (steps, s) = stream(&tok, &ids, &["<|im_end|>"], false);
    assert_eq!(s.text(), "Hello");
    assert_eq!(steps.last().unwrap().stopped.as_deref(), Some("<|im_end|>"));
}

#[test]
fn pushing_after_a_stop_is_a_protocol_error() {
    let tok = tokenizer();
    let ids = tok.encode("ab ab", false).unwrap();
    let mut s = TextStream::new(strings(&["b"]), true);
    let mut stopped = false;
    for &id in &ids {
        if s.push(&tok, id).unwrap().stopped.is_some() {
            stopped = true;
            break;
        }
    }
    assert!(stopped);
    assert!(matches!(s.push(&tok, ids[0]), Err(Error::Protocol(_))));
    assert_eq!(s.flush(), "", "a stopped stream releases nothing more");
    assert_eq!(s.text(), "a");
}

#[test]
fn emitted_text_matches_truncate_at_stop_for_many_stop_choices() {
    let tok = tokenizer();
    let text = "Once upon a time there was a little cat who liked to sleep in the sun. 🙂 東京";
    let ids = tok.encode(text, false).unwrap();
    let chars: Vec<char> = text.chars().collect();
    // Every substring of length 1..4 starting at every third character, as a stop.
    for start in (0..chars.len()).step_by(3) {
        for len in 1..=4.min(chars.len() - start) {
            let stop: String = chars[start..start + len].iter().collect();
            let (steps, mut s) = stream(&tok, &ids, &[&stop], false);
            let (expected, found) = truncate_at_stop(text, std::slice::from_ref(&stop));
            let rest = if found.is_some() { String::new() } else { s.flush() };
            assert_eq!(concatenated(&steps) + &rest, expected, "stop {stop:?}");
            assert_eq!(s.stopped(), found.as_deref());
        }
    }
}

/// Streams `ids` with the stream's vLLM options until it stops; returns the emitted text and the stop.
fn stream_with(tok: &Tokenizer, ids: &[u32], stops: &[&str], include_stop: bool, min_tokens: usize) -> (String, Option<String>, usize) {
    let mut s = TextStream::with_options(strings(stops), false, include_stop, min_tokens);
    let mut text = String::new();
    for (i, &id) in ids.iter().enumerate() {
        let step = s.push(tok, id).unwrap();
        text.push_str(&step.text);
        assert_eq!(text, s.text());
        if step.stopped.is_some() {
            return (text, step.stopped, i + 1);
        }
    }
    text.push_str(&s.flush());
    (text, None, ids.len())
}

#[test]
fn include_stop_keeps_the_stop_string_and_cuts_after_it() {
    let tok = tokenizer();
    let ids = tok.encode("The capital of France is Paris. The capital of Italy is Rome.", false).unwrap();
    let (text, stop, _) = stream_with(&tok, &ids, &["Paris", "Rome"], true, 0);
    assert_eq!(text, "The capital of France is Paris");
    assert_eq!(stop.as_deref(), Some("Paris"));
    // A stop inside a single token: the token's text after the stop is cut.
    let (text, stop, _) = stream_with(&tok, &ids, &["pit"], true, 0);
    assert_eq!((text.as_str(), stop.as_deref()), ("The capit", Some("pit")));
    // Without the option the same stream ends before the stop.
    let (text, _, _) = stream_with(&tok, &ids, &["Paris"], false, 0);
    assert_eq!(text, "The capital of France is ");
}

#[test]
fn stops_ending_within_the_first_min_tokens_do_not_count() {
    let tok = tokenizer();
    let ids = tok.encode("The capital of France is Paris. The capital of Italy is Rome.", false).unwrap();
    let paris_ends = (1..=ids.len()).find(|&n| tok.decode(&ids[..n], false).unwrap().contains("Paris")).unwrap();
    // "capital" ends in the text of the first paris_ends tokens, so with that many as min_tokens only its second
    // occurrence, after "Paris", stops the stream.
    let (text, stop, pushed) = stream_with(&tok, &ids, &["capital"], false, paris_ends);
    assert_eq!(text, "The capital of France is Paris. The ");
    assert_eq!(stop.as_deref(), Some("capital"));
    assert!(pushed > paris_ends);
    // A stop that ends in the first token past min_tokens counts, though it began inside their text.
    let (text, stop, pushed) = stream_with(&tok, &ids, &["Paris"], false, paris_ends - 1);
    assert_eq!((text.as_str(), stop.as_deref(), pushed), ("The capital of France is ", Some("Paris"), paris_ends));
    // min_tokens at that token: "Paris" ends inside the protected text, and no later "Paris" comes.
    let (text, stop, _) = stream_with(&tok, &ids, &["Paris"], false, paris_ends);
    assert_eq!((text.as_str(), stop), ("The capital of France is Paris. The capital of Italy is Rome.", None));
    // With a stop included and min_tokens, the later occurrence is kept in the text.
    let (text, _, _) = stream_with(&tok, &ids, &["capital"], true, paris_ends);
    assert_eq!(text, "The capital of France is Paris. The capital");
}
