//! The terminal chat of `ferrum run`: a message per line, or several lines between `"""`
//! marks; `/system TEXT`, `/image FILE` (a vision model's: the image goes with the next
//! message), `/clear`, `/exit`. Ctrl-C stops the answer being written and returns to the
//! prompt; Ctrl-D (end of input) or `/exit` leaves.

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use ferrum_backend::Backend;
use ferrum_generate::{GenerateOptions, Session};
use ferrum_tokenizer::Message;
use indicatif::{ProgressBar, ProgressStyle};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// A spinner on stderr while something slow runs (only on a terminal).
pub fn spinner(msg: &str) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let s = ProgressBar::new_spinner();
    s.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").ok()?);
    s.set_message(msg.to_string());
    s.enable_steady_tick(Duration::from_millis(100));
    Some(s)
}

/// Reads one message: a line, or the lines between `"""` marks. `None` at end of input.
fn read_message(input: &mut impl BufRead) -> std::io::Result<Option<String>> {
    let mut line = String::new();
    eprint!("> ");
    let _ = std::io::stderr().flush();
    if input.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let first = line.trim_end_matches(['\n', '\r']);
    let Some(rest) = first.trim_start().strip_prefix("\"\"\"") else {
        return Ok(Some(first.to_string()));
    };
    // Multi-line: until a line that ends with the closing mark.
    if let Some(done) = rest.strip_suffix("\"\"\"") {
        return Ok(Some(done.to_string()));
    }
    let mut lines = vec![rest.to_string()];
    loop {
        eprint!(". ");
        let _ = std::io::stderr().flush();
        line.clear();
        if input.read_line(&mut line)? == 0 {
            break;
        }
        let l = line.trim_end_matches(['\n', '\r']);
        if let Some(last) = l.strip_suffix("\"\"\"") {
            lines.push(last.to_string());
            break;
        }
        lines.push(l.to_string());
    }
    let text = lines.join("\n");
    Ok(Some(text.trim_matches('\n').to_string()))
}

pub fn chat<B: Backend>(
    session: &mut Session<B>,
    mut messages: Vec<Message>,
    opts: &GenerateOptions,
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    // Ctrl-C interrupts the answer, not the program.
    if let Err(e) = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst)) {
        eprintln!("ferrum: Ctrl-C will end the program ({e})");
    }
    let vision = session.engine.model.vision.is_some();
    eprintln!(
        "Type a message (\"\"\" starts and ends several lines). /system TEXT sets the system \
         prompt, {}/clear starts over, /exit or Ctrl-D leaves; Ctrl-C stops an answer.",
        if vision {
            "/image FILE attaches an image to the next message, "
        } else {
            ""
        }
    );
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    // Each user message's images (the k-th user message's at k), and those attached to the
    // next one. The whole conversation's images go with every turn: the prefix cache keeps
    // their rows, so only a new image's are computed again.
    let mut user_images: Vec<Vec<ferrum_image::Processed>> = Vec::new();
    let mut pending = Vec::new();
    loop {
        INTERRUPTED.store(false, Ordering::SeqCst);
        let Some(text) = read_message(&mut input)? else {
            break;
        };
        let trimmed = text.trim();
        if trimmed.is_empty() {
            continue;
        }
        match trimmed {
            "/exit" | "/quit" | "/bye" => break,
            "/clear" => {
                messages.retain(|m| m.role == "system");
                user_images.clear();
                pending.clear();
                // Nothing to reset: the next prompt simply shares no prefix with the cache.
                eprintln!("(conversation cleared)");
                continue;
            }
            "/system" => {
                messages.retain(|m| m.role != "system");
                eprintln!("(system prompt removed)");
                continue;
            }
            _ => {}
        }
        if let Some(system) = trimmed.strip_prefix("/system ") {
            messages.retain(|m| m.role != "system");
            messages.insert(0, Message::new("system", system.trim()));
            eprintln!("(system prompt set)");
            continue;
        }
        if let Some(path) = trimmed.strip_prefix("/image ") {
            // A path dragged into a terminal comes quoted.
            let path = path.trim().trim_matches(|c| c == '\'' || c == '"');
            match crate::load_image(session, Path::new(path)) {
                Ok(px) => {
                    pending.push(px);
                    eprintln!("(image {path} attached: it goes with your next message)");
                }
                Err(e) => eprintln!("ferrum: {e:#}"),
            }
            continue;
        }
        if trimmed.starts_with('/') && !trimmed.contains(char::is_whitespace) {
            eprintln!(
                "unknown command {trimmed}: /system TEXT, {}/clear, /exit",
                if vision { "/image FILE, " } else { "" }
            );
            continue;
        }
        messages.push(Message::new("user", text.clone()));
        user_images.push(std::mem::take(&mut pending));
        let turn = if user_images.iter().all(Vec::is_empty) {
            crate::render(session.tokenizer(), &messages, kwargs).map(|ids| (ids, Vec::new()))
        } else {
            crate::render_with_images(session, &messages, &user_images, kwargs)
        };
        let answer = turn.and_then(|(ids, images)| {
            let opts = GenerateOptions {
                images,
                ..opts.clone()
            };
            crate::answer(session, &ids, &opts, &INTERRUPTED)
        });
        match answer {
            Ok(answer) => messages.push(Message::new("assistant", answer)),
            Err(e) => {
                // A turn that cannot run (e.g. the conversation outgrew the context) is
                // reported and dropped with its images; the chat goes on.
                eprintln!("ferrum: {e:#}");
                messages.pop();
                user_images.pop();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::read_message;

    #[test]
    fn one_line_or_a_triple_quoted_block() {
        let mut one = "hello\nworld\n".as_bytes();
        assert_eq!(read_message(&mut one).unwrap().as_deref(), Some("hello"));
        let mut block = "\"\"\"first\nsecond\nthird\"\"\"\nnext\n".as_bytes();
        assert_eq!(
            read_message(&mut block).unwrap().as_deref(),
            Some("first\nsecond\nthird")
        );
        assert_eq!(read_message(&mut block).unwrap().as_deref(), Some("next"));
        let mut inline = "\"\"\"just this\"\"\"\n".as_bytes();
        assert_eq!(
            read_message(&mut inline).unwrap().as_deref(),
            Some("just this")
        );
        assert_eq!(read_message(&mut "".as_bytes()).unwrap(), None);
    }
}
