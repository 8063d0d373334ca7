//! The layering rules of ARCHITECTURE.md, checked on the source: every `crate::X` path in a
//! module's code (comments and the unit-test module at the end of a file aside) must name a
//! module of a lower layer, so imports run downhill and no two folders depend on each other.

use std::collections::BTreeMap;
use std::path::Path;

/// Top-level modules of `src/` by layer, lowest first. A module may use only modules of a lower
/// layer; modules of one layer are independent of each other.
const LAYERS: &[&[&str]] = &[
    // Leaves: no crate imports at all.
    &[
        "device",
        "fault",
        "flag",
        "interrupt",
        "output",
        "progress",
        "rng",
        "scheme",
    ],
    // Storage and raw compute.
    &["checkpoint", "kernels"],
    // The domain: where models come from, what they compute, how they are quantized and stored.
    &["calib", "format", "gptq", "model", "source"],
    // What a serving engine loads.
    &["engine"],
    // The commands.
    &["eval", "gguf", "inspect", "pack_marlin", "synth"],
    // quantize runs eval for --verify; sensitivity scores variants with eval's protocol.
    &["quantize", "sensitivity"],
    // The command line.
    &["cli"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The code of a file without comments and without its trailing `#[cfg(test)] mod tests`.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("#[cfg(test)]")
            && lines.get(i + 1).is_some_and(|l| l.starts_with("mod tests"))
        {
            break;
        }
        let code = match line.find("//") {
            Some(p) => &line[..p],
            None => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// The top-level modules a piece of code names through `crate::` (`crate::a::b`,
/// `crate::{a, b::c}`, and the `outln!` macro, which lives in `output`).
fn crate_refs(code: &str) -> Vec<String> {
    let mut refs = vec![];
    let mut rest = code;
    while let Some(p) = rest.find("crate::") {
        // `$crate::` in a macro body is the same path.
        rest = &rest[p + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    refs.push(name);
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            refs.push(if name == "outln" {
                "output".to_string()
            } else {
                name
            });
        }
    }
    refs
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_import_runs_downhill() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    rust_files(&src, &mut files);
    files.sort();
    let mut uphill: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut unknown = vec![];
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "main" || top == "lib" {
            continue;
        }
        let Some(from) = layer_of(&top) else {
            unknown.push(top.clone());
            continue;
        };
        let text = std::fs::read_to_string(f).unwrap();
        for to in crate_refs(&code_of(&text)) {
            if to == top {
                continue;
            }
            match layer_of(&to) {
                Some(l) if l < from => {}
                Some(_) => uphill
                    .entry(format!("{} ({top})", rel.display()))
                    .or_default()
                    .push(to),
                None => unknown.push(to),
            }
        }
    }
    unknown.sort();
    unknown.dedup();
    assert!(
        unknown.is_empty(),
        "modules missing from the layer table (add them to LAYERS and ARCHITECTURE.md): {unknown:?}"
    );
    assert!(
        uphill.is_empty(),
        "imports that run uphill or sideways (see ARCHITECTURE.md, Layers): {uphill:#?}"
    );
}

#[test]
fn the_layer_table_matches_src_and_the_code_map() {
    // Every top-level module of lib.rs is in the table, and the table names no module that is
    // gone; ARCHITECTURE.md states the same layers.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let mut declared: Vec<String> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';').to_string())
        .collect();
    declared.sort();
    let mut table: Vec<String> = LAYERS
        .iter()
        .flat_map(|l| l.iter().map(|m| m.to_string()))
        .collect();
    table.sort();
    assert_eq!(declared, table, "src/lib.rs modules vs the layer table");
    let map = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    for (i, layer) in LAYERS.iter().enumerate() {
        let line = map
            .lines()
            .find(|l| l.starts_with(&format!("{i}. ")))
            .unwrap_or_else(|| panic!("ARCHITECTURE.md has no layer line `{i}. ...`"));
        for m in *layer {
            assert!(
                line.contains(&format!("`{m}`")),
                "ARCHITECTURE.md layer {i} does not list `{m}`: {line}"
            );
        }
    }
}

#[test]
fn the_checker_sees_every_spelling_of_an_import() {
    let code = code_of(
        "use crate::model::AnyConfig;\n\
         // use crate::cli::hidden;\n\
         let x = crate::gptq::solve(); // crate::eval in a comment\n\
         use crate::{format, source::Source};\n\
         outln!(\"{}\", $crate::output::x);\n\
         #[cfg(test)]\nmod tests {\n use crate::quantize;\n}\n",
    );
    assert_eq!(
        crate_refs(&code),
        ["model", "gptq", "format", "source", "output"]
    );
}
