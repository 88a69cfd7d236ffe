//! Chat templates: the Jinja template shipped with a model (tokenizer_config.json `chat_template`, or GGUF
//! `tokenizer.chat_template`), rendered the way Hugging Face transformers' `apply_chat_template` does.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};

use crate::error::{Error, Result};
use crate::request::Message;

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template plus the special-token strings templates refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// What `raise_exception(msg)` throws; found again in the error's source chain so the caller gets the
/// template author's message as an invalid-request error.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

impl ChatTemplate {
    /// Compiles `source`; a template that does not compile is a model load error.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = transformers_like_environment();
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| Error::Load(format!("the model's chat template does not compile: {e}")))?;
        Ok(Self { env, bos_token, eos_token })
    }

    /// Renders a conversation into the prompt text (to be tokenized without adding special tokens:
    /// templates write BOS themselves when the model wants it).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Error::Internal(format!("compiled chat template went missing: {e}")))?;
        template.render(self.context(messages, add_generation_prompt)).map_err(render_error)
    }

    fn context(&self, messages: &[Message], add_generation_prompt: bool) -> Value {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| Value::from_iter([("role", m.role.as_str()), ("content", m.content.as_str())]))
            .collect();
        let mut vars =
            vec![("messages", Value::from(messages)), ("add_generation_prompt", Value::from(add_generation_prompt))];
        // An absent special token stays undefined, as in transformers (which omits it from the context).
        if let Some(bos) = &self.bos_token {
            vars.push(("bos_token", Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            vars.push(("eos_token", Value::from(eos.as_str())));
        }
        Value::from_iter(vars)
    }
}

/// transformers compiles chat templates with `ImmutableSandboxedEnvironment(trim_blocks=True,
/// lstrip_blocks=True)`, Jinja2's default `keep_trailing_newline=False`, and adds `raise_exception`,
/// `strftime_now` and its own `tojson`; Python string methods come from pycompat.
fn transformers_like_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", python_tojson);
    env
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

fn render_error(err: minijinja::Error) -> Error {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&err);
    while let Some(s) = source {
        if let Some(raised) = s.downcast_ref::<RaisedException>() {
            return Error::InvalidRequest(format!("the chat template refused these messages: {}", raised.0));
        }
        source = s.source();
    }
    Error::InvalidRequest(format!("the model's chat template failed to render these messages: {err}"))
}

fn strftime_now(format: String) -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    strftime_utc(&format, secs)
}

/// transformers' `tojson` is `json.dumps(x, ensure_ascii=False, indent=indent)`: Python's separators
/// (", " and ": ", or "," and newlines when indenting) and no HTML escaping, unlike minijinja's built-in.
fn python_tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Accepted for compatibility; output is always ensure_ascii=False with minijinja's key order.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&spaces),
            );
            serde::Serialize::serialize(&value, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonCompactFormatter);
            serde::Serialize::serialize(&value, &mut ser)
        }
    };
    written.map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson failed: {e}")))?;
    let json = String::from_utf8(out).expect("serde_json writes UTF-8");
    Ok(Value::from_safe_string(json))
}

/// Python's default `json.dumps` separators: ", " between items and ": " after keys.
struct PythonCompactFormatter;

impl serde_json::ser::Formatter for PythonCompactFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

struct CivilTime {
    year: i64,
    month: u32,     // 1..=12
    day: u32,       // 1..=31
    yday: u32,      // 1..=366
    weekday: usize, // 0 = Sunday
    hour: u32,
    minute: u32,
    second: u32,
}

/// UTC calendar fields of a Unix time (Howard Hinnant's days-to-civil algorithm).
fn civil_time(unix_secs: i64) -> CivilTime {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400) as u32;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_from_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_from_march + 2) / 153;
    let day = (doy_from_march - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const DAYS_BEFORE_MONTH: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = DAYS_BEFORE_MONTH[month as usize - 1] + day + u32::from(leap && month > 2);
    CivilTime {
        year,
        month,
        day,
        yday,
        weekday: (days + 4).rem_euclid(7) as usize, // 1970-01-01 was a Thursday
        hour: secs_of_day / 3600,
        minute: secs_of_day / 60 % 60,
        second: secs_of_day % 60,
    }
}

/// Python's `strftime` for the directives chat templates use (dates in system prompts), in UTC: we carry
/// no time-zone database, and servers usually run in UTC anyway. glibc's `%-d` (no padding) is honoured;
/// unknown directives are copied through unchanged, as glibc does.
pub(crate) fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let t = civil_time(unix_secs);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut directive = chars.next();
        let unpadded = directive == Some('-');
        if unpadded {
            directive = chars.next();
        }
        let num = |v: u32, width: usize| if unpadded { v.to_string() } else { format!("{v:0width$}") };
        let hour12 = if t.hour.is_multiple_of(12) { 12 } else { t.hour % 12 };
        let piece = match directive {
            Some('Y') => t.year.to_string(),
            Some('y') => num(t.year.rem_euclid(100) as u32, 2),
            Some('m') => num(t.month, 2),
            Some('d') => num(t.day, 2),
            Some('e') => format!("{:>2}", t.day),
            Some('j') => num(t.yday, 3),
            Some('H') => num(t.hour, 2),
            Some('I') => num(hour12, 2),
            Some('M') => num(t.minute, 2),
            Some('S') => num(t.second, 2),
            Some('p') => (if t.hour < 12 { "AM" } else { "PM" }).to_string(),
            Some('B') => MONTHS[t.month as usize - 1].to_string(),
            Some('b') | Some('h') => MONTHS[t.month as usize - 1][..3].to_string(),
            Some('A') => WEEKDAYS[t.weekday].to_string(),
            Some('a') => WEEKDAYS[t.weekday][..3].to_string(),
            Some('F') => format!("{}-{:02}-{:02}", t.year, t.month, t.day),
            Some('T') => format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second),
            Some('Z') => "UTC".to_string(),
            Some('z') => "+0000".to_string(),
            Some('%') => "%".to_string(),
            Some(other) => format!("%{}{other}", if unpadded { "-" } else { "" }),
            None => format!("%{}", if unpadded { "-" } else { "" }),
        };
        out.push_str(&piece);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(content: &str) -> Message {
        Message { role: "user".into(), content: content.into() }
    }

    const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders_with_and_without_generation_prompt() {
        let t = ChatTemplate::new(CHATML, None, Some("<|im_end|>".into())).unwrap();
        let msgs = [user("Hi")];
        assert_eq!(t.render(&msgs, true).unwrap(), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(t.render(&msgs, false).unwrap(), "<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn compile_error_is_a_load_error() {
        let err = ChatTemplate::new("{% for m in messages %}", None, None).unwrap_err();
        assert!(matches!(&err, Error::Load(m) if m.contains("chat template")), "{err}");
    }

    #[test]
    fn raise_exception_becomes_invalid_request_with_its_message() {
        let src =
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System message required') }}{% endif %}ok";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let err = t.render(&[user("x")], false).unwrap_err();
        assert!(matches!(&err, Error::InvalidRequest(m) if m.contains("System message required")), "{err}");
    }

    #[test]
    fn trim_and_lstrip_blocks_and_trailing_newline_match_transformers() {
        // Jinja2 with trim_blocks + lstrip_blocks drops the block lines entirely, and the template's single
        // trailing newline is removed (keep_trailing_newline=False).
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert_eq!(t.render(&[user("a"), user("b")], false).unwrap(), "[a]\n[b]\n");
    }

    #[test]
    fn special_tokens_and_python_string_methods_are_available() {
        let src = "{{ bos_token }}{{ messages[0].content.strip().upper() }}{% if messages[0].content.startswith(' h') %}!{% endif %}{{ eos_token }}{% if pad_token is defined %}pad{% endif %}";
        let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).unwrap();
        assert_eq!(t.render(&[user(" hi ")], false).unwrap(), "<s>HI!</s>");
        let no_bos = ChatTemplate::new("{% if bos_token is defined %}bos{% endif %}x", None, None).unwrap();
        assert_eq!(no_bos.render(&[], false).unwrap(), "x");
    }

    #[test]
    fn tojson_uses_python_separators_without_html_escaping() {
        let t =
            ChatTemplate::new("{{ messages[0] | tojson }}|{{ [1, 'a<b'] | tojson(indent=2) }}", None, None).unwrap();
        assert_eq!(
            t.render(&[user("é")], false).unwrap(),
            "{\"content\": \"é\", \"role\": \"user\"}|[\n  1,\n  \"a<b\"\n]"
        );
    }

    #[test]
    fn strftime_now_is_callable_from_templates() {
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None).unwrap();
        let year: i64 = t.render(&[], false).unwrap().parse().unwrap();
        assert!(year >= 2025);
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime_utc("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime_utc("%A %B %-d, %y %j", t), "Friday July 26, 24 208");
        assert_eq!(strftime_utc("%H:%M:%S %I%p %F %T %% %Q", t), "13:05:09 01PM 2024-07-26 13:05:09 % %Q");
        assert_eq!(strftime_utc("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime_utc("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }
}
