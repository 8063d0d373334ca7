//! Flag values several commands share, parsed while clap reads the command line: a bad value is
//! a usage error (exit 2) before anything is read or downloaded, with the same message wherever
//! the flag appears.

/// A positive whole number (`--nsamples`, `--batch`, `--max-windows`).
pub fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s} is not a positive whole number")),
    }
}

/// A positive number of bytes (`--shard-size`).
pub fn bytes(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s} is not a positive number of bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_sizes_are_positive() {
        assert_eq!(positive("8"), Ok(8));
        assert_eq!(bytes("1024"), Ok(1024));
        for s in ["0", "-1", "x", "", "1.5"] {
            assert!(
                positive(s).unwrap_err().contains("positive whole number"),
                "{s}"
            );
            assert!(
                bytes(s).unwrap_err().contains("positive number of bytes"),
                "{s}"
            );
        }
    }
}
