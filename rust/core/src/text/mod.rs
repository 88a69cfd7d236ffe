//! Text: tokenization, chat templates, incremental detokenization and stop strings.
mod byte_decode;
pub mod chat_template;
mod sentence_piece;
pub mod stop;
pub mod tokenizer;

pub use chat_template::ChatTemplate;
pub use stop::{truncate_at_stop, StreamStep, TextStream};
pub use tokenizer::{BpeVocab, Tokenizer, VocabModel};
