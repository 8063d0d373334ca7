//! The docs check themselves: every `docs/X.md, Heading` citation in the code and every
//! `X.md#anchor` link in the docs and the README resolve to a heading that exists, and the
//! synopses of docs/usage.md list exactly the flags each command has (and the README's only
//! flags that exist).

use clap::CommandFactory;
use std::collections::BTreeSet;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The headings (`#`, `##`, ...) of a markdown file, outside code blocks.
fn headings(md: &str) -> Vec<String> {
    let mut out = vec![];
    let mut code = false;
    for line in md.lines() {
        if line.starts_with("```") {
            code = !code;
        } else if !code && line.starts_with('#') {
            out.push(line.trim_start_matches('#').trim().to_string());
        }
    }
    out
}

/// What a citation may name: the headings, and the bold lead terms of list items
/// (`- **Hessians follow inputs**: ...`, the stable names of docs/decisions.md).
fn names(md: &str) -> Vec<String> {
    let mut out = headings(md);
    for line in md.lines() {
        if let Some(rest) = line.strip_prefix("- **") {
            if let Some(end) = rest.find("**") {
                out.push(rest[..end].replace('`', ""));
            }
        }
    }
    out
}

/// Whether `cited` names `name`: equal, or one runs on past the other at a non-letter
/// ("GPTQ" for "GPTQ (what `quantize` writes)", "Post-processing, gives the rules" for
/// "Post-processing"), ignoring case.
fn names_match(cited: &str, name: &str) -> bool {
    let (c, n) = (cited.to_lowercase(), name.to_lowercase());
    let (long, short) = if c.len() >= n.len() {
        (&c, &n)
    } else {
        (&n, &c)
    };
    long.starts_with(short.as_str())
        && !long[short.len()..]
            .chars()
            .next()
            .is_some_and(|ch| ch.is_alphanumeric())
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation other than `-` and `_`
/// dropped.
fn slug(h: &str) -> String {
    h.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn files_under(dir: &Path, ext: &str, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files_under(&p, ext, out);
        } else if p.extension().is_some_and(|x| x == ext) {
            out.push(p);
        }
    }
}

/// `text` with comment markers removed and lines joined, so that a citation wrapped over two
/// comment lines reads as one.
fn joined_comments(text: &str) -> String {
    text.lines()
        .map(|l| {
            let t = l.trim_start();
            t.trim_start_matches("//!")
                .trim_start_matches("///")
                .trim_start_matches("//")
                .trim()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `(file, cited heading)` of every `docs/X.md, Heading` in `text`: the heading runs to the
/// next `)`, `]`, `;`, `:` or `.`.
fn citations(text: &str) -> Vec<(String, String)> {
    let mut out = vec![];
    let mut rest = text;
    while let Some(p) = rest.find("docs/") {
        rest = &rest[p + 5..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let after = &rest[name.len()..];
        let Some(after) = after.strip_prefix(".md, ") else {
            continue;
        };
        let end = after
            .find([')', ']', ';', ':', '.', '"', '`'])
            .unwrap_or(after.len());
        let cited = after[..end].trim();
        if cited.chars().next().is_some_and(|c| c.is_uppercase()) {
            out.push((format!("{name}.md"), cited.to_string()));
        }
    }
    out
}

#[test]
fn every_docs_citation_in_the_code_names_a_heading() {
    let mut files = vec![];
    for d in ["src", "tests", "examples"] {
        files_under(&root().join(d), "rs", &mut files);
    }
    files.push(root().join("build.rs"));
    let mut missing = vec![];
    let mut checked = 0;
    for f in files
        .iter()
        .filter(|f| !f.ends_with("tests/integration/docs.rs"))
    {
        let text = joined_comments(&std::fs::read_to_string(f).unwrap());
        for (doc, cited) in citations(&text) {
            let Ok(md) = std::fs::read_to_string(root().join("docs").join(&doc)) else {
                missing.push(format!("{}: docs/{doc} does not exist", f.display()));
                continue;
            };
            checked += 1;
            let ok = names(&md).iter().any(|h| names_match(&cited, h));
            if !ok {
                missing.push(format!("{}: docs/{doc}, {cited}", f.display()));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} citations found: is the pattern still right?"
    );
    assert!(
        missing.is_empty(),
        "citations of headings that do not exist: {missing:#?}"
    );
}

#[test]
fn every_anchor_link_in_the_docs_names_a_heading() {
    let mut files = vec![root().join("README.md"), root().join("ARCHITECTURE.md")];
    files_under(&root().join("docs"), "md", &mut files);
    let mut missing = vec![];
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let mut rest = text.as_str();
        while let Some(p) = rest.find(".md#") {
            let before = &rest[..p];
            let start = before.rfind(['(', '/', ' ']).map_or(0, |i| i + 1);
            let name = before[start..].to_string();
            rest = &rest[p + 4..];
            let anchor: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            // `gpu.md#x` next to the linking file, `docs/gpu.md#x` from the top.
            let target = if name.is_empty() {
                f.clone()
            } else {
                let here = f.parent().unwrap().join(format!("{name}.md"));
                if here.is_file() {
                    here
                } else {
                    root().join("docs").join(format!("{name}.md"))
                }
            };
            let Ok(md) = std::fs::read_to_string(&target) else {
                missing.push(format!("{}: {name}.md#{anchor}: no such file", f.display()));
                continue;
            };
            if !headings(&md).iter().any(|h| slug(h) == anchor) {
                missing.push(format!("{}: {name}.md#{anchor}", f.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "links to anchors that do not exist: {missing:#?}"
    );
}

/// The long flags of each command's synopsis in a markdown file: the code-block lines that
/// start with `soar-gptq COMMAND` and their continuation lines.
fn synopsis_flags(md: &str) -> Vec<(String, BTreeSet<String>)> {
    let mut out: Vec<(String, BTreeSet<String>)> = vec![];
    let mut code = false;
    let mut current: Option<usize> = None;
    for line in md.lines() {
        if line.starts_with("```") {
            code = !code;
            current = None;
            continue;
        }
        if !code {
            continue;
        }
        if let Some(rest) = line.strip_prefix("soar-gptq ") {
            let cmd: String = rest.split_whitespace().next().unwrap_or("").to_string();
            out.push((cmd, BTreeSet::new()));
            current = Some(out.len() - 1);
        } else if !line.starts_with(' ') {
            current = None;
        }
        if let Some(i) = current {
            let mut rest = line;
            while let Some(p) = rest.find("--") {
                rest = &rest[p + 2..];
                let flag: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '-')
                    .collect();
                if !flag.is_empty() {
                    out[i].1.insert(flag);
                }
            }
        }
    }
    out
}

fn clap_flags(cmd: &str) -> BTreeSet<String> {
    let cli = soar_gptq::cli::Cli::command();
    let sub = cli
        .get_subcommands()
        .find(|s| s.get_name() == cmd)
        .unwrap_or_else(|| panic!("no command {cmd}"));
    sub.get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter_map(|a| a.get_long().map(str::to_string))
        .filter(|l| l != "help" && l != "version")
        .collect()
}

#[test]
fn the_usage_synopses_list_exactly_the_flags_each_command_has() {
    let usage = std::fs::read_to_string(root().join("docs/usage.md")).unwrap();
    let synopses = synopsis_flags(&usage);
    let cli = soar_gptq::cli::Cli::command();
    let commands: BTreeSet<String> = cli
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    let documented: BTreeSet<String> = synopses.iter().map(|(c, _)| c.clone()).collect();
    assert_eq!(
        documented, commands,
        "docs/usage.md synopses vs the commands"
    );
    for (cmd, flags) in &synopses {
        let have = clap_flags(cmd);
        assert_eq!(
            flags, &have,
            "docs/usage.md synopsis of {cmd}: documented flags (left) vs the command's (right)"
        );
    }
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    for (cmd, flags) in synopsis_flags(&readme) {
        let have = clap_flags(&cmd);
        let stale: Vec<&String> = flags.difference(&have).collect();
        assert!(
            stale.is_empty(),
            "README synopsis of {cmd} names flags it lacks: {stale:?}"
        );
    }
}
