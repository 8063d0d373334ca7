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

/// The module path of `file` under `src/` (`src/quantize/layers/pass.rs` → quantize, layers,
/// pass; a `mod.rs` is its folder's module).
fn module_path(rel: &Path) -> Vec<String> {
    let mut p: Vec<String> = rel
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    if p.last().is_some_and(|l| l == "mod") {
        p.pop();
    }
    p
}

/// Every module path a file's code names, resolved to absolute paths: `crate::a::b`,
/// `super::x` (from the file's parent module; `super::super::` further up), `self::x`, with
/// `{a, b::c}` groups expanded one level; and in a `mod.rs`, `use x::…` of its own child `x`.
fn module_refs(code: &str, here: &[String], children: &[String]) -> Vec<Vec<String>> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = vec![];
    for (start, _) in code.match_indices(['c', 's']) {
        let rest = &code[start..];
        // A path must start a token.
        if start > 0 {
            let prev = code[..start].chars().next_back().unwrap_or(' ');
            if prev.is_alphanumeric() || prev == '_' || prev == ':' || prev == '$' {
                continue;
            }
        }
        let (mut base, mut rest) = if let Some(r) = rest.strip_prefix("crate::") {
            (vec![], r)
        } else if let Some(r) = rest.strip_prefix("self::") {
            (here.to_vec(), r)
        } else if rest.starts_with("super::") {
            let mut b = here.to_vec();
            let mut r = rest;
            while let Some(rr) = r.strip_prefix("super::") {
                b.pop();
                r = rr;
            }
            (b, r)
        } else {
            continue;
        };
        // Walk `a::b::` segments, then the last segment or a `{...}` group.
        loop {
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let name = ident(item.trim());
                    if !name.is_empty() && name != "self" {
                        let mut p = base.clone();
                        p.push(name);
                        out.push(p);
                    }
                }
                out.push(base.clone());
                break;
            }
            let name = ident(rest);
            if name.is_empty() {
                break;
            }
            base.push(name.clone());
            rest = &rest[name.len()..];
            match rest.strip_prefix("::") {
                Some(r) => rest = r,
                None => {
                    out.push(base.clone());
                    break;
                }
            }
        }
    }
    if !children.is_empty() {
        for line in code.lines() {
            let l = line.trim_start();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            if let Some(r) = l.strip_prefix("use ") {
                let name = ident(r);
                if children.contains(&name) {
                    let mut p = here.to_vec();
                    p.push(name);
                    out.push(p);
                }
            }
        }
    }
    out
}

/// The cycles of a directed graph, each as the nodes of one strongly connected component of more
/// than one node (Tarjan's algorithm), sorted.
fn cycles(graph: &BTreeMap<String, std::collections::BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'g> {
        g: &'g BTreeMap<String, std::collections::BTreeSet<String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on: std::collections::BTreeSet<&'g str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(t: &mut T<'g>, v: &'g str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = vec![];
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: vec![],
        on: Default::default(),
        next: 0,
        out: vec![],
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out.sort();
    t.out
}

/// Inside every folder, the graph of its sibling modules (files and subfolders; a file of a
/// subfolder counts as the subfolder) by the module paths their code names.
fn sibling_graphs(
    src: &Path,
) -> BTreeMap<String, BTreeMap<String, std::collections::BTreeSet<String>>> {
    let mut files = vec![];
    rust_files(src, &mut files);
    files.sort();
    let mut graphs: BTreeMap<String, BTreeMap<String, std::collections::BTreeSet<String>>> =
        BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap();
        let here = module_path(rel);
        if here.is_empty() || here == ["main"] || here == ["lib"] {
            continue;
        }
        let is_mod = rel.file_name().is_some_and(|n| n == "mod.rs");
        let children: Vec<String> = if is_mod {
            std::fs::read_dir(f.parent().unwrap())
                .unwrap()
                .filter_map(|e| {
                    let p = e.unwrap().path();
                    let n = p.file_stem()?.to_string_lossy().to_string();
                    (n != "mod").then_some(n)
                })
                .collect()
        } else {
            vec![]
        };
        let text = std::fs::read_to_string(f).unwrap();
        let refs = module_refs(&code_of(&text), &here, &children);
        // Every folder above the file: its node there is the component right below the folder.
        for depth in 0..here.len() {
            let folder = &here[..depth];
            if depth + 1 > here.len() || (is_mod && depth + 1 == here.len() + 1) {
                continue;
            }
            let node = here[depth].clone();
            // A mod.rs is its folder's module, not a sibling inside it.
            if is_mod && depth + 1 == here.len() {
                continue;
            }
            let dir = if folder.is_empty() {
                "src".to_string()
            } else {
                format!("src/{}", folder.join("/"))
            };
            let dir_path = src.join(folder.join("/"));
            for r in &refs {
                if r.len() > depth && r[..depth] == *folder && r[depth] != node {
                    let target = &r[depth];
                    let exists = dir_path.join(format!("{target}.rs")).is_file()
                        || dir_path.join(target).is_dir();
                    if exists {
                        graphs
                            .entry(dir.clone())
                            .or_default()
                            .entry(node.clone())
                            .or_default()
                            .insert(target.clone());
                    }
                }
            }
        }
    }
    graphs
}

#[test]
fn no_import_circles_inside_any_folder() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = vec![];
    for (dir, g) in sibling_graphs(&src) {
        // The top level is the layer table's business (`every_import_runs_downhill`).
        if dir == "src" {
            continue;
        }
        for c in cycles(&g) {
            found.push(format!("{dir}: {}", c.join(" <-> ")));
        }
    }
    assert!(
        found.is_empty(),
        "modules of one folder that import each other (move what they share into a module \
         both use): {found:#?}"
    );
}

#[test]
fn the_circle_check_finds_an_injected_circle() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path();
    let d = src.join("pkg");
    std::fs::create_dir_all(d.join("sub")).unwrap();
    std::fs::write(
        d.join("mod.rs"),
        "mod a;\nmod b;\nmod c;\nmod sub;\nuse a::X;\n",
    )
    .unwrap();
    std::fs::write(d.join("a.rs"), "use super::b::Y;\n").unwrap();
    std::fs::write(d.join("b.rs"), "use crate::pkg::{c, sub::Z};\n").unwrap();
    std::fs::write(
        d.join("c.rs"),
        "// use super::a;\nfn f() { super::Item; }\n",
    )
    .unwrap();
    std::fs::write(d.join("sub").join("mod.rs"), "mod z;\n").unwrap();
    std::fs::write(d.join("sub").join("z.rs"), "use super::super::a::X;\n").unwrap();
    let g = &sibling_graphs(src)["src/pkg"];
    assert_eq!(cycles(g), vec![vec!["a", "b", "sub"]]);
    // Without the edge that closes it, no circle.
    std::fs::write(d.join("sub").join("z.rs"), "use super::super::c::X;\n").unwrap();
    assert!(cycles(&sibling_graphs(src)["src/pkg"]).is_empty());
}
