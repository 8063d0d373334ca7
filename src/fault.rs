//! Fault injection for the tests: with `SOAR_GPTQ_FAULT_AT=N` in the environment, the N-th fault
//! point the process reaches aborts it on the spot, as `kill -9` or a power cut would (no
//! destructor, no cleanup); with `SOAR_GPTQ_FAULT_KIND=enospc` too, the N-th point that is a
//! write fails with "No space left on device" instead, as a full disk would. Fault points sit before and between every write, rename and layer,
//! so a test can stop a run at each of them in turn and prove that the next run resumes or
//! restarts to byte-identical output. Unset, a fault point is one relaxed atomic load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

static REACHED: AtomicU64 = AtomicU64::new(0);

fn target() -> Option<u64> {
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    *AT.get_or_init(|| {
        std::env::var("SOAR_GPTQ_FAULT_AT")
            .ok()
            .and_then(|v| v.parse().ok())
    })
}

fn enospc() -> bool {
    static KIND: OnceLock<bool> = OnceLock::new();
    *KIND.get_or_init(|| std::env::var("SOAR_GPTQ_FAULT_KIND").is_ok_and(|k| k == "enospc"))
}

/// A place where a crash must be survivable; `what` is printed when the fault fires there.
pub fn point(what: &str) {
    if let Some(n) = target() {
        if !enospc() && REACHED.fetch_add(1, Ordering::SeqCst) + 1 == n {
            eprintln!("fault injected at point {n}: {what}");
            std::process::abort();
        }
    }
}

/// A write point: aborts like [`point`], or fails as a full disk would under
/// `SOAR_GPTQ_FAULT_KIND=enospc`.
pub fn write_point(what: &str) -> std::io::Result<()> {
    if let Some(n) = target() {
        if REACHED.fetch_add(1, Ordering::SeqCst) + 1 == n {
            eprintln!("fault injected at write point {n}: {what}");
            if enospc() {
                return Err(std::io::Error::from_raw_os_error(28));
            }
            std::process::abort();
        }
    }
    Ok(())
}

/// Testing aid: pauses for the milliseconds the environment variable `var` names (unset: no
/// pause), so the tests can signal a run at a known point.
pub fn delay(var: &str) {
    if let Some(ms) = std::env::var(var).ok().and_then(|v| v.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}
