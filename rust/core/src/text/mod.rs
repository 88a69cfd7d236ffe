//! Text: tokenization, chat templates, incremental detokenization and stop strings.
pub mod chat_template;
pub mod stop;
pub mod tokenizer;
