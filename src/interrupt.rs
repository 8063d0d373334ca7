//! Ctrl-C and SIGTERM. A long GPU run stopped by the user or a scheduler ends with exit code
//! 130 (SIGINT) or 143 (SIGTERM) and one message saying what was kept: a partial quantize
//! output with finished layers stays for `--resume`; every other partial folder and lock file
//! is removed. Nothing is ever half-renamed: the signal waits for a commit in progress
//! ([`critical`]) to finish first.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// Partial folders and lock files of the outputs being written.
static OPEN: Mutex<Vec<(PathBuf, PathBuf)>> = Mutex::new(Vec::new());
/// Temporary files of single-file outputs being written (`guard::OutputFile`).
static TEMP_FILES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// Held while an output is renamed into place.
static CRITICAL: Mutex<()> = Mutex::new(());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts the thread that handles SIGINT and SIGTERM (once, from `main`).
pub fn install() {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
        return;
    };
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let _commit = lock(&CRITICAL);
            let name = if sig == SIGINT { "SIGINT" } else { "SIGTERM" };
            let mut kept = vec![];
            for (partial, lockfile) in lock(&OPEN).iter() {
                if let Some(n) = resumable_layers(partial) {
                    kept.push(format!(
                        "{n} finished layer(s) are kept in {}: rerun the same command with \
                         --resume to continue",
                        partial.display()
                    ));
                } else {
                    // A background writer may still be adding files: a second pass catches them.
                    for _ in 0..3 {
                        if std::fs::remove_dir_all(partial).is_ok() || !partial.exists() {
                            break;
                        }
                    }
                }
                let _ = std::fs::remove_file(lockfile);
            }
            for tmp in lock(&TEMP_FILES).iter() {
                let _ = std::fs::remove_file(tmp);
            }
            if kept.is_empty() {
                eprintln!("interrupted ({name}): nothing was written");
            } else {
                eprintln!("interrupted ({name}): {}", kept.join("; "));
            }
            std::process::exit(128 + sig);
        }
    });
}

/// The file, inside a partial output folder, that lists finished layers: its presence makes the
/// folder resumable (`quantize --resume`), so it survives an interrupt and `--force` is needed to
/// discard it.
pub const RESUMABLE_MARKER: &str = "journal/journal.json";

/// Finished layers recorded in a partial quantize folder's journal, if any.
fn resumable_layers(partial: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(partial.join(RESUMABLE_MARKER)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let n = v["layers"].as_array()?.len();
    (n > 0).then_some(n)
}

/// Records an output being written (its partial folder and lock file) until the guard drops.
pub fn register(partial: &Path, lockfile: &Path) -> Registration {
    lock(&OPEN).push((partial.to_path_buf(), lockfile.to_path_buf()));
    Registration {
        partial: partial.to_path_buf(),
    }
}

pub struct Registration {
    partial: PathBuf,
}

impl Drop for Registration {
    fn drop(&mut self) {
        lock(&OPEN).retain(|(p, _)| p != &self.partial);
    }
}

/// Records the temporary file of a single-file output until the guard drops; a signal removes
/// it.
pub fn register_temp_file(tmp: &Path) -> TempRegistration {
    lock(&TEMP_FILES).push(tmp.to_path_buf());
    TempRegistration {
        tmp: tmp.to_path_buf(),
    }
}

pub struct TempRegistration {
    tmp: PathBuf,
}

impl Drop for TempRegistration {
    fn drop(&mut self) {
        lock(&TEMP_FILES).retain(|p| p != &self.tmp);
    }
}

/// Held while an output is renamed into place: a signal waits for it.
pub fn critical() -> MutexGuard<'static, ()> {
    lock(&CRITICAL)
}
