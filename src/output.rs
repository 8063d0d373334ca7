//! Standard output that never panics. `println!` panics when stdout is closed (`| head`, `| true`)
//! or full (`> /dev/full`), which turned a finished run into exit code 101 after its checkpoint
//! was written. Everything the commands print goes through [`outln!`](crate::outln): the first
//! failed write is recorded and later lines are dropped; [`finish`] flushes and says what
//! happened, so the binary can exit quietly on a closed pipe and with a clear error otherwise.

use std::io::Write;
use std::sync::Mutex;

static FAILED: Mutex<Option<std::io::Error>> = Mutex::new(None);

/// Writes one line to stdout unless an earlier write failed (then the line is dropped).
pub fn line(args: std::fmt::Arguments) {
    let mut failed = FAILED.lock().unwrap_or_else(|p| p.into_inner());
    if failed.is_some() {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(format_args!("{args}\n")) {
        *failed = Some(e);
    }
}

/// Flushes stdout; the first write error of the run, if any.
pub fn finish() -> Option<std::io::Error> {
    let mut failed = FAILED.lock().unwrap_or_else(|p| p.into_inner());
    if failed.is_none() {
        if let Err(e) = std::io::stdout().flush() {
            *failed = Some(e);
        }
    }
    failed.take()
}

/// `println!` for the commands' output: never panics (see the module docs).
#[macro_export]
macro_rules! outln {
    () => {
        $crate::output::line(format_args!(""))
    };
    ($($t:tt)*) => {
        $crate::output::line(format_args!($($t)*))
    };
}
