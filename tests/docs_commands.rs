//! Every command the README and docs/ show runs as written: each ```sh block parses
//! (`bash -n`), and each `shunt ...` and `cargo xtask ...` line in it names subcommands
//! and flags that the built binaries accept (checked against their own `--help`), and
//! each repository file it names (`deploy/...`) exists.

use std::path::{Path, PathBuf};
use std::process::Command;

use harness::shunt_bin;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// The pages users read: the README and docs/*.md.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![repo().join("README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The ```sh blocks of a page, with the line each starts at.
fn sh_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        match &mut current {
            None if line.trim_start() == "```sh" => current = Some((i + 1, String::new())),
            Some(_) if line.trim_start().starts_with("```") => blocks.extend(current.take()),
            Some((_, block)) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// The block's commands: continuation lines joined, comments dropped.
fn commands(block: &str) -> Vec<String> {
    let joined = block.replace("\\\n", " ");
    joined
        .lines()
        .map(|l| match l.find(" #") {
            Some(i) => &l[..i],
            None if l.trim_start().starts_with('#') => "",
            None => l,
        })
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The words of a command after `program` (`shunt`, or `cargo xtask`), if it runs it.
fn words_after<'a>(words: &'a [String], program: &[&str]) -> Option<&'a [String]> {
    (0..words.len())
        .find(|&i| {
            words[i..].len() >= program.len()
                && words[i..i + program.len()]
                    .iter()
                    .zip(program)
                    .all(|(w, p)| w == p || (program.len() == 1 && w.ends_with(&format!("/{p}"))))
        })
        .map(|i| &words[i + program.len()..])
}

/// Checks one invocation against the binary's help: its subcommand path (the words
/// before the first flag, as long as `--help` accepts them) and each flag used.
fn check_invocation(bin: &Path, args: &[String], what: &str) -> Vec<String> {
    let mut path: Vec<&str> = Vec::new();
    let mut help = help_of(bin, &path).expect("the top-level help");
    for word in args.iter().take_while(|w| !w.starts_with('-')) {
        let mut longer = path.clone();
        longer.push(word);
        match help_of(bin, &longer) {
            Some(h) if subcommand_listed(&help, word) => {
                path = longer;
                help = h;
            }
            _ => break,
        }
    }
    let mut problems = Vec::new();
    // A program with subcommands is always called with one.
    if path.is_empty() && help.contains("Commands:") {
        problems.push(format!(
            "{what}: `{}` has no subcommand {:?}",
            bin.file_name().unwrap().to_string_lossy(),
            args.first().map(String::as_str).unwrap_or("")
        ));
    }
    for flag in args.iter().filter(|w| w.starts_with('-') && w.len() > 1) {
        let name = flag.split('=').next().unwrap();
        let known = if name.starts_with("--") {
            help.contains(&format!("{name} "))
                || help.contains(&format!("{name}\n"))
                || help.contains(&format!("{name}="))
                || help.contains(&format!("{name} <"))
        } else {
            help.contains(&format!("{name}, ")) || help.contains(&format!("{name} <"))
        };
        if !known {
            problems.push(format!(
                "{what}: `{}` does not accept {name}",
                std::iter::once(bin.file_name().unwrap().to_string_lossy().into_owned())
                    .chain(path.iter().map(|s| s.to_string()))
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
    }
    problems
}

fn subcommand_listed(help: &str, word: &str) -> bool {
    help.lines()
        .any(|l| l.split_whitespace().next() == Some(word))
}

fn help_of(bin: &Path, path: &[&str]) -> Option<String> {
    let out = Command::new(bin).args(path).arg("--help").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn xtask_bin() -> PathBuf {
    let bin = shunt_bin().parent().unwrap().join("xtask");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p xtask` (cargo xtask test does)",
        bin.display()
    );
    bin
}

#[test]
fn every_shell_block_in_the_readme_and_docs_runs_as_written() {
    let shunt = shunt_bin();
    let xtask = xtask_bin();
    let mut problems = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(repo()).unwrap().display().to_string();
        for (line, block) in sh_blocks(&text) {
            let what = format!("{name}:{line}");
            let parse = Command::new("bash")
                .arg("-n")
                .arg("-c")
                .arg(&block)
                .output()
                .unwrap();
            if !parse.status.success() {
                problems.push(format!(
                    "{what}: bash cannot parse it: {}",
                    String::from_utf8_lossy(&parse.stderr)
                ));
            }
            for command in commands(&block) {
                let words: Vec<String> = command.split_whitespace().map(str::to_owned).collect();
                // Placeholders such as [--rounds N] or FILTER are usage, not a command.
                if command.contains('[') || command.contains('|') {
                    continue;
                }
                if let Some(args) = words_after(&words, &["cargo", "xtask"]) {
                    problems.extend(check_invocation(&xtask, args, &what));
                    checked += 1;
                } else if words[0] == "cargo" {
                    // `cargo build -p shunt` names the package, not the program.
                } else if let Some(args) = words_after(&words, &["shunt"]) {
                    problems.extend(check_invocation(&shunt, args, &what));
                    checked += 1;
                }
                for file in words.iter().filter(|w| w.starts_with("deploy/")) {
                    if !repo().join(file).exists() {
                        problems.push(format!("{what}: {file} does not exist"));
                    }
                }
            }
        }
    }
    assert!(
        checked >= 10,
        "only {checked} commands found: is the block marker still ```sh?"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn a_wrong_flag_or_subcommand_is_caught() {
    let problems = check_invocation(
        &shunt_bin(),
        &["proxy".into(), "--no-such-flag".into()],
        "self-check",
    );
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("shunt proxy"), "{problems:?}");
    let problems = check_invocation(&xtask_bin(), &["dmo".into()], "self-check");
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("no subcommand \"dmo\""),
        "{problems:?}"
    );
}
