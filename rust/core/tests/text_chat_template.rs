//! Chat templates rendered as transformers' apply_chat_template renders them.

use std::path::PathBuf;

use stepllm_core::request::Message;
use stepllm_core::text::ChatTemplate;
use stepllm_core::Error;

fn msg(role: &str, content: &str) -> Message {
    Message { role: role.into(), content: content.into() }
}

/// SmolLM2-135M-Instruct's template, copied from its GGUF metadata key tokenizer.chat_template.
pub const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[test]
fn fixture_chatml_template_renders_the_expected_prompt() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama/tokenizer_config.json");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let template = ChatTemplate::new(
        config["chat_template"].as_str().unwrap(),
        config["bos_token"].as_str().map(String::from),
        config["eos_token"].as_str().map(String::from),
    )
    .unwrap();
    let rendered = template.render(&[msg("user", "Hello, how are you?")], true).unwrap();
    assert_eq!(rendered, "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn smollm2_template_adds_its_default_system_message() {
    let template = ChatTemplate::new(SMOLLM2_TEMPLATE, Some("<|im_start|>".into()), Some("<|im_end|>".into())).unwrap();
    let rendered = template.render(&[msg("user", "Give me one word that rhymes with cat.")], true).unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nGive me one word that rhymes with cat.<|im_end|>\n<|im_start|>assistant\n"
    );
    // A caller's own system message replaces the default one.
    let own = template.render(&[msg("system", "Be brief."), msg("user", "Hi")], false).unwrap();
    assert_eq!(own, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

#[test]
fn only_one_trailing_newline_of_the_template_is_dropped() {
    // Jinja2's keep_trailing_newline=False (transformers' setting) removes exactly one final newline.
    let one = ChatTemplate::new("{{ messages | length }}\n", None, None).unwrap();
    let two = ChatTemplate::new("{{ messages | length }}\n\n", None, None).unwrap();
    assert_eq!(one.render(&[], false).unwrap(), "0");
    assert_eq!(two.render(&[], false).unwrap(), "0\n");
}

#[test]
fn alternation_check_of_a_template_reports_its_message() {
    // The shape of many real templates (Mistral, Gemma): roles must alternate user/assistant.
    let src = "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{{ message['content'] }}{% endfor %}";
    let template = ChatTemplate::new(src, None, None).unwrap();
    assert_eq!(template.render(&[msg("user", "a"), msg("assistant", "b")], false).unwrap(), "ab");
    let err = template.render(&[msg("user", "a"), msg("user", "b")], false).unwrap_err();
    assert!(matches!(&err, Error::InvalidRequest(m) if m.contains("roles must alternate")), "{err}");
}

#[test]
fn errors_that_are_not_raised_exceptions_are_still_reported() {
    let template = ChatTemplate::new("{{ messages[0].content.no_such_method() }}", None, None).unwrap();
    let err = template.render(&[msg("user", "x")], false).unwrap_err();
    assert!(matches!(&err, Error::InvalidRequest(m) if m.contains("failed to render")), "{err}");
}
