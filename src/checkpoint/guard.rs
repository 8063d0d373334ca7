//! Guards for everything a command writes: an output may never be, contain or sit inside one of
//! the command's inputs (resolved to canonical paths, symlinks followed), may never be `.`, `..`,
//! `/` or a folder above the current one, and is held by an advisory lock while it is being
//! written, so that two runs on one `--out` cannot destroy each other's work.
//!
//! The rule comes from data loss: `quantize --model M --out M --force` used to replace the source
//! with its own output, and spellings such as `M/`, `M/../M`, a symlink to `M` or a parent of `M`
//! did the same. Every command passes its inputs to [`OutputDir`](super::OutputDir), which calls
//! [`check_output`] before it touches the disk; a single file at a path the user names goes
//! through [`OutputFile`], which adds the rules of files (never a folder or device, an existing
//! file only with `--force`, a fresh exclusive temporary name).

use anyhow::{bail, Context, Result};
use std::io::{Read, Seek, Write};
use std::path::{Component, Path, PathBuf};

/// Free bytes on the filesystem that holds `path` (or its nearest existing ancestor), where the
/// OS says.
pub fn free_disk_bytes(path: &Path) -> Option<u64> {
    let mut p = resolve(path).ok()?;
    while !p.exists() {
        p = p.parent()?.to_path_buf();
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a valid NUL-terminated path and `s` a properly sized out-parameter.
        if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
            return None;
        }
        Some(s.f_bavail as u64 * s.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Refuses to start writing `needed` bytes for `flag` where the filesystem has less free (with
/// a 2% margin), naming both figures and what takes the space.
pub fn check_disk_space(flag: &str, out: &Path, needed: u64, what: &str) -> Result<()> {
    let Some(free) = free_disk_bytes(out) else {
        return Ok(());
    };
    let want = needed + needed / 50;
    if want > free {
        bail!(
            "not enough free space for {flag} {}: it needs {:.2} GB ({what}) and its filesystem \
             has {:.2} GB free; free some space or choose an {flag} on another disk",
            out.display(),
            want as f64 / 1e9,
            free as f64 / 1e9
        );
    }
    Ok(())
}

/// Refuses an input that is not a regular file (after symlinks): opening a FIFO blocks until a
/// writer appears, and a device or folder is never a model file. `what` names it in the message.
pub fn regular_file(path: &Path, what: &str) -> Result<()> {
    let m = std::fs::metadata(path)
        .with_context(|| format!("cannot read {what} {}", path.display()))?;
    if !m.is_file() {
        bail!(
            "{what} {} is not a regular file ({}): pass the file itself",
            path.display(),
            if m.is_dir() {
                "a folder"
            } else {
                "a FIFO, socket or device, which would block or never end"
            }
        );
    }
    Ok(())
}

/// One input of a command: the flag that named it (for messages) and its path.
#[derive(Debug, Clone)]
pub struct InputPath {
    pub flag: String,
    pub path: PathBuf,
}

impl InputPath {
    pub fn new(flag: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        Self {
            flag: flag.into(),
            path: path.into(),
        }
    }
}

/// The inputs of a model folder: the folder itself and, where its files are symlinks (a hub
/// snapshot points into the cache's `blobs/`), every file they point to.
pub fn model_inputs(flag: &str, dir: &Path) -> Vec<InputPath> {
    let mut v = vec![InputPath::new(flag, dir)];
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut targets: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_symlink()))
            .filter_map(|e| std::fs::canonicalize(e.path()).ok())
            .collect();
        targets.sort();
        v.extend(targets.into_iter().map(|t| InputPath::new(flag, t)));
    }
    v
}

/// `path` made absolute with every symlink of its existing part followed and `.`/`..` folded;
/// the part that does not exist yet is appended as written.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .context("cannot read the current folder")?
            .join(path)
    };
    // Fold `.` and `..` lexically first only where the path does not exist: an existing prefix
    // is canonicalized by the OS, which resolves `..` after following symlinks, as open() does.
    let comps: Vec<Component> = abs.components().collect();
    let mut existing = comps.len();
    while existing > 0 {
        let p: PathBuf = comps[..existing].iter().collect();
        if p.symlink_metadata().is_ok() {
            break;
        }
        existing -= 1;
    }
    let mut out = if existing == 0 {
        PathBuf::from("/")
    } else {
        let p: PathBuf = comps[..existing].iter().collect();
        std::fs::canonicalize(&p).unwrap_or(p)
    };
    for c in &comps[existing..] {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    Ok(out)
}

/// True when the last component as written is `.` or `..` (`Path::components` folds a trailing
/// `.` away, so the spelling is checked on the string).
fn names_dot(path: &Path) -> bool {
    let s = path.to_string_lossy();
    let s = s.trim_end_matches('/');
    let last = s.rsplit('/').next().unwrap_or("");
    s.is_empty() || last == "." || last == ".."
}

/// Refuses an output (`flag` = its option, e.g. `--out`) that is `.`/`..`, the root, the current
/// folder or one above it, or that equals, contains or sits inside one of `inputs`. `extra` are
/// further paths the command will write or delete for this output (its `.partial` folder).
pub fn check_output(flag: &str, out: &Path, extra: &[PathBuf], inputs: &[InputPath]) -> Result<()> {
    let shown = out.display();
    if names_dot(out) {
        bail!(
            "{flag} {shown} names the current or parent folder: give the output its own new \
             folder (e.g. {flag} ./model-gptq)"
        );
    }
    let cwd = std::env::current_dir()
        .ok()
        .and_then(|c| std::fs::canonicalize(c).ok());
    let mut targets = vec![resolve(out)?];
    for e in extra {
        targets.push(resolve(e)?);
    }
    for t in &targets {
        if t.parent().is_none() {
            bail!("{flag} {shown} is the root folder: give the output its own new folder");
        }
        if let Some(c) = &cwd {
            if c.starts_with(t) {
                bail!(
                    "{flag} {shown} is the current folder or a folder above it ({}): writing \
                     there would replace the folder you are in; give the output its own new folder",
                    t.display()
                );
            }
        }
        for input in inputs {
            let Ok(i) = std::fs::canonicalize(&input.path).or_else(|_| resolve(&input.path)) else {
                continue;
            };
            let how = if *t == i {
                "is"
            } else if i.starts_with(t) {
                "contains"
            } else if t.starts_with(&i) {
                "is inside"
            } else {
                continue;
            };
            let target = if t == &targets[0] {
                String::new()
            } else {
                format!(" (through {})", t.display())
            };
            bail!(
                "{flag} {shown}{target} {how} the input {} {} ({}): inputs are never modified; \
                 choose an {flag} outside every input",
                input.flag,
                input.path.display(),
                i.display()
            );
        }
    }
    Ok(())
}

/// A file a command writes at a path the user named (`sensitivity --plan-out`, the files of
/// `quantize --save-hessians`): [`OutputFile::check`] runs every check before any heavy work,
/// [`OutputFile::write`] writes it.
///
/// The rules: the path (symlinks followed) may not be, or sit inside, any input of the command;
/// it may not name a folder; what is there may only be a regular file, and is replaced only with
/// `force` (a device node, FIFO or socket is never replaced); its folder must exist. The content
/// goes to a fresh temporary file beside it (a new name, created exclusively, so never an
/// existing file and never an input), is synced, and is renamed into place; a failed or
/// interrupted write removes the temporary file and leaves what was there as it was.
#[derive(Debug, Clone)]
pub struct OutputFile {
    flag: String,
    /// As the user wrote it, for messages.
    shown: PathBuf,
    /// Where it is written: absolute, symlinks followed.
    target: PathBuf,
    force: bool,
    inputs: Vec<InputPath>,
}

impl OutputFile {
    /// Checks `path` as the output file of `flag` against `inputs`; `force` allows replacing
    /// an existing regular file.
    pub fn check(flag: &str, path: &Path, force: bool, inputs: &[InputPath]) -> Result<Self> {
        let spelled = path.to_string_lossy();
        if spelled.is_empty() || names_dot(path) || spelled.ends_with('/') {
            bail!(
                "{flag} {spelled:?} names a folder: give the name of a file (e.g. {flag} \
                 plan.json)"
            );
        }
        check_output(flag, path, &[], inputs)?;
        let target = resolve(path)?;
        let me = Self {
            flag: flag.to_string(),
            shown: path.to_path_buf(),
            target,
            force,
            inputs: inputs.to_vec(),
        };
        me.check_target()?;
        let parent = me.target.parent().unwrap_or(Path::new("/"));
        match std::fs::metadata(parent) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => bail!(
                "{flag} {}: {} is not a folder",
                me.shown.display(),
                parent.display()
            ),
            Err(_) => bail!(
                "{flag} {}: its folder {} does not exist; create it first or choose a file in \
                 an existing folder",
                me.shown.display(),
                parent.display()
            ),
        }
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            if let Ok(c) = std::ffi::CString::new(parent.as_os_str().as_bytes()) {
                // SAFETY: `c` is a valid NUL-terminated path.
                if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
                    bail!(
                        "{flag} {}: the folder {} is not writable ({}); choose another place",
                        me.shown.display(),
                        parent.display(),
                        std::io::Error::last_os_error()
                    );
                }
            }
        }
        Ok(me)
    }

    /// The path as the user gave it.
    pub fn path(&self) -> &Path {
        &self.shown
    }

    /// What is at the target now may be replaced: nothing, or a regular file with `force`.
    fn check_target(&self) -> Result<()> {
        let (flag, shown) = (&self.flag, self.shown.display());
        let m = match std::fs::symlink_metadata(&self.target) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("cannot read {flag} {shown}")),
        };
        let t = m.file_type();
        if t.is_symlink() {
            bail!(
                "{flag} {shown} is a symlink to a file that does not exist ({}): remove the link \
                 or choose another name",
                std::fs::read_link(&self.target)
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            );
        }
        if t.is_dir() {
            bail!(
                "{flag} {shown} is a folder: give the name of a file (e.g. {flag} {})",
                self.shown.join("plan.json").display()
            );
        }
        if !t.is_file() {
            bail!(
                "{flag} {shown} is not a regular file (a device, FIFO or socket): it is never \
                 replaced, even with --force; choose the name of a file"
            );
        }
        if !self.force {
            bail!(
                "{flag} {shown} already exists: pass --force to replace it, or choose another name"
            );
        }
        Ok(())
    }

    /// Writes the file: `write` fills a fresh temporary file beside it (given its path), which
    /// is synced and renamed into place. On any failure the temporary file is removed and the
    /// target left as it was.
    pub fn write(&self, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = self.target.parent().unwrap_or(Path::new("/"));
        let name = self
            .target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (tmp, file) = loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let tmp = dir.join(format!(".{name}.{}-{n}.tmp", std::process::id()));
            check_output(&self.flag, &tmp, &[], &self.inputs)?;
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
            {
                Ok(f) => break (tmp, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!(
                            "cannot create a temporary file in {} for {} {}",
                            dir.display(),
                            self.flag,
                            self.shown.display()
                        )
                    })
                }
            }
        };
        let registered = crate::interrupt::register_temp_file(&tmp);
        drop(file);
        let written = write(&tmp)
            .and_then(|()| -> Result<()> {
                std::fs::File::open(&tmp)?.sync_all()?;
                Ok(crate::fault::write_point("a temporary file written")?)
            })
            .with_context(|| format!("cannot write {} (disk full?)", tmp.display()))
            // Whatever appeared at the target meanwhile is checked again before it is replaced.
            .and_then(|()| self.check_target());
        let renamed = written.and_then(|()| {
            let _commit = crate::interrupt::critical();
            std::fs::rename(&tmp, &self.target).with_context(|| {
                format!(
                    "cannot rename {} to {}",
                    tmp.display(),
                    self.target.display()
                )
            })
        });
        if let Err(e) = renamed {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        drop(registered);
        // The rename itself made durable (best effort: not every filesystem syncs folders).
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

/// An advisory lock on `<out>.lock`, held while a command writes `<out>` (released on drop and
/// by the OS when the process dies). A second run on the same output is refused at once with
/// the holder's pid.
pub struct OutputLock {
    path: PathBuf,
    _file: std::fs::File,
}

pub fn lock_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_os_string();
    s.push(".lock");
    PathBuf::from(s)
}

impl OutputLock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn acquire(flag: &str, out: &Path) -> Result<Self> {
        let path = lock_path(out);
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create the folder of {flag} {}", out.display()))?;
        }
        loop {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .with_context(|| format!("cannot create the lock file {}", path.display()))?;
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => {
                    let mut holder = String::new();
                    let _ = file.read_to_string(&mut holder);
                    let holder = holder.trim();
                    bail!(
                        "{flag} {} is being written by another soar-gptq run ({}; lock {}): wait \
                         for it to finish or stop it, or choose another {flag}",
                        out.display(),
                        if holder.is_empty() {
                            "pid unknown".to_string()
                        } else {
                            format!("pid {holder}")
                        },
                        path.display()
                    );
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("cannot lock {}", path.display()))
                }
            }
            // The holder before us may have removed the file after we opened it: the lock is
            // only ours if the path still names the file we locked.
            let same = match (file.metadata(), std::fs::metadata(&path)) {
                (Ok(a), Ok(b)) => same_file(&a, &b),
                _ => false,
            };
            if !same {
                continue;
            }
            file.set_len(0)?;
            file.rewind()?;
            write!(file, "{}", std::process::id())?;
            return Ok(Self { path, _file: file });
        }
    }
}

#[cfg(unix)]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_file(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    true
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    #[test]
    fn resolve_folds_spellings_of_one_folder() {
        let root = tempfile::tempdir().unwrap();
        let m = root.path().join("m");
        std::fs::create_dir(&m).unwrap();
        std::fs::create_dir(m.join("sub")).unwrap();
        let canon = std::fs::canonicalize(&m).unwrap();
        for spelling in [
            m.clone(),
            PathBuf::from(format!("{}/", m.display())),
            m.join("..").join("m"),
            m.join("sub").join(".."),
            m.join("."),
        ] {
            assert_eq!(resolve(&spelling).unwrap(), canon, "{}", spelling.display());
        }
        // A symlink is followed; a path below a missing folder keeps its written tail.
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&m, &link).unwrap();
        assert_eq!(resolve(&link).unwrap(), canon);
        assert_eq!(
            resolve(&link.join("new").join("x")).unwrap(),
            canon.join("new").join("x")
        );
        assert_eq!(
            resolve(&root.path().join("nope").join("..").join("m")).unwrap(),
            canon
        );
    }

    #[test]
    fn outputs_that_alias_inputs_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let m = root.path().join("models").join("m");
        std::fs::create_dir_all(&m).unwrap();
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&m, &link).unwrap();
        let inputs = [InputPath::new("--model", &link)];
        let refused = |out: PathBuf, how: &str| {
            let e = check_output("--out", &out, &[], &inputs)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(how) && e.contains("--model"),
                "{}: {e}",
                out.display()
            );
        };
        refused(m.clone(), "is the input");
        refused(PathBuf::from(format!("{}/", m.display())), "is the input");
        refused(m.join("..").join("m"), "is the input");
        refused(link.clone(), "is the input");
        refused(root.path().join("models"), "contains the input");
        refused(root.path().to_path_buf(), "contains the input");
        refused(m.join("gptq"), "is inside the input");
        refused(link.join("gptq"), "is inside the input");
        // The partial folder of an output is checked too.
        let e = check_output(
            "--out",
            &root.path().join("x"),
            std::slice::from_ref(&m),
            &inputs,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("through"), "{e}");
        // A sibling is fine.
        check_output("--out", &root.path().join("models/m-gptq"), &[], &inputs).unwrap();
        check_output("--out", &root.path().join("models/m2"), &[], &inputs).unwrap();
    }

    #[test]
    fn dot_root_and_folders_above_the_current_one_are_refused() {
        for out in [".", "..", "./", "../", "a/..", "a/.", ""] {
            let e = check_output("--out", Path::new(out), &[], &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("current or parent"), "{out:?}: {e}");
        }
        let e = check_output("--out", Path::new("/"), &[], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("root") || e.contains("current or parent"), "{e}");
        let cwd = std::env::current_dir().unwrap();
        let parent = cwd.parent().unwrap().to_path_buf();
        for out in [cwd, parent] {
            let e = check_output("--out", &out, &[], &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("folder above it"), "{}: {e}", out.display());
        }
    }

    fn files_in(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn an_output_file_never_replaces_an_input_nor_writes_through_an_existing_name() {
        let root = tempfile::tempdir().unwrap();
        let data = root.path().join("d.txt");
        std::fs::write(&data, "input").unwrap();
        let model = root.path().join("m");
        std::fs::create_dir(&model).unwrap();
        let inputs = [
            InputPath::new("--model", &model),
            InputPath::new("--data", &data),
        ];
        // The input itself, by any spelling, and a file inside an input folder.
        for (out, needle) in [
            (data.clone(), "is the input --data"),
            (root.path().join("m/../d.txt"), "is the input --data"),
            (model.join("plan.json"), "is inside the input --model"),
        ] {
            let e = OutputFile::check("--plan-out", &out, true, &inputs)
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{}: {e}", out.display());
        }
        let link = root.path().join("link.json");
        std::os::unix::fs::symlink(&data, &link).unwrap();
        let e = OutputFile::check("--plan-out", &link, true, &inputs)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is the input --data d") || e.contains("--data"),
            "{e}"
        );
        assert!(!e.contains("an input"), "{e}");
        assert_eq!(std::fs::read_to_string(&data).unwrap(), "input");

        // An input named like the temporary file of another output is never touched: the
        // temporary name is fresh and created exclusively.
        let tmp_named = root.path().join("t.json.tmp");
        std::fs::write(&tmp_named, "input too").unwrap();
        let inputs = [InputPath::new("--data", &tmp_named)];
        let out =
            OutputFile::check("--plan-out", &root.path().join("t.json"), false, &inputs).unwrap();
        out.write(|p| Ok(std::fs::write(p, "plan")?)).unwrap();
        assert_eq!(std::fs::read_to_string(&tmp_named).unwrap(), "input too");
        assert_eq!(
            std::fs::read_to_string(root.path().join("t.json")).unwrap(),
            "plan"
        );
    }

    #[test]
    fn an_output_file_replaces_only_regular_files_and_only_with_force() {
        let root = tempfile::tempdir().unwrap();
        let old = root.path().join("plan.json");
        std::fs::write(&old, "old").unwrap();
        let e = OutputFile::check("--plan-out", &old, false, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("already exists") && e.contains("--force"), "{e}");
        let out = OutputFile::check("--plan-out", &old, true, &[]).unwrap();
        out.write(|p| Ok(std::fs::write(p, "new")?)).unwrap();
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "new");

        // A FIFO or a device is never replaced, even with --force.
        let fifo = root.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for p in [fifo.as_path(), Path::new("/dev/null")] {
            let e = OutputFile::check("--plan-out", p, true, &[])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("not a regular file") && e.contains("never"),
                "{e}"
            );
        }
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());

        // A symlink is followed: its target is what is checked and replaced.
        let target = root.path().join("v2.json");
        std::fs::write(&target, "v2").unwrap();
        let link = root.path().join("current.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        OutputFile::check("--plan-out", &link, true, &[])
            .unwrap()
            .write(|p| Ok(std::fs::write(p, "v3")?))
            .unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "v3");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        let dangling = root.path().join("dangling.json");
        std::os::unix::fs::symlink(root.path().join("nope"), &dangling).unwrap();
        let e = OutputFile::check("--plan-out", &dangling, true, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
    }

    #[test]
    fn an_output_file_is_refused_up_front_for_folders_and_missing_folders() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("plans");
        std::fs::create_dir(&dir).unwrap();
        let e = OutputFile::check("--plan-out", &dir, true, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("is a folder"), "{e}");
        for spelled in [".", "..", "", "plans/"] {
            let e = OutputFile::check("--plan-out", Path::new(spelled), true, &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("names a folder"), "{spelled:?}: {e}");
        }
        let missing = root.path().join("nope").join("plan.json");
        let e = OutputFile::check("--plan-out", &missing, true, &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("does not exist")
                && e.contains(&root.path().join("nope").display().to_string()),
            "{e}"
        );
        // Nothing was created by any of these checks.
        assert_eq!(files_in(root.path()), ["plans"]);
    }

    #[test]
    fn a_failed_output_file_write_leaves_nothing_behind() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("plan.json");
        std::fs::write(&target, "old").unwrap();
        let out = OutputFile::check("--plan-out", &target, true, &[]).unwrap();
        let e = out
            .write(|p| {
                std::fs::write(p, "half")?;
                bail!("the disk filled up")
            })
            .unwrap_err();
        assert!(format!("{e:#}").contains("the disk filled up"), "{e:#}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "old");
        assert_eq!(files_in(root.path()), ["plan.json"]);
        // A folder put where the file goes after the check: refused at the write, no leftovers.
        let late = root.path().join("late.json");
        let out = OutputFile::check("--plan-out", &late, true, &[]).unwrap();
        std::fs::create_dir(&late).unwrap();
        let e = out.write(|p| Ok(std::fs::write(p, "x")?)).unwrap_err();
        assert!(e.to_string().contains("is a folder"), "{e}");
        assert_eq!(files_in(root.path()), ["late.json", "plan.json"]);
    }

    #[test]
    fn free_space_is_read_and_a_write_beyond_it_refused() {
        let root = tempfile::tempdir().unwrap();
        let free = free_disk_bytes(&root.path().join("not/yet/there")).unwrap();
        assert!(free > 0);
        check_disk_space("--out", &root.path().join("q"), 1, "one byte").unwrap();
        let e = check_disk_space("--out", &root.path().join("q"), free * 2, "the shards")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not enough free space for --out") && e.contains("the shards"),
            "{e}"
        );
    }

    #[test]
    fn a_second_lock_on_one_output_is_refused_with_the_holders_pid() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("q");
        let first = OutputLock::acquire("--out", &out).unwrap();
        let e = OutputLock::acquire("--out", &out)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(first);
        assert!(!lock_path(&out).exists());
        OutputLock::acquire("--out", &out).unwrap();
    }
}
