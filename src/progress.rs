//! Progress bars on stderr, drawn only when stderr is a terminal (never on a pipe or in CI logs).
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    pb.set_style(
        ProgressStyle::with_template("{prefix:>10} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}")
            .expect("valid template"),
    );
    pb.set_prefix(what.to_string());
    pb
}

/// A line above the bar; plain stderr when the bar is hidden (pipes, CI logs), where indicatif
/// would drop it.
pub fn println(pb: &ProgressBar, line: String) {
    if pb.is_hidden() {
        eprintln!("{line}");
    } else {
        pb.println(line);
    }
}
