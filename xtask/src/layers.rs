//! The layer check of `cargo xtask lint`: inside each crate of several top-level
//! modules, which may use which (between crates, Cargo checks it).
//!
//! A top-level module is one declared with `mod x;` in `proxy/src/main.rs` or `lib.rs`
//! (`proxy/src/x.rs` or `proxy/src/x/`); the crate roots themselves are the modules
//! `main` and `lib`. Every `.rs` file under a module is read (test code too), comments
//! and string literals are blanked out, and each `crate::y...` path (in `use` lines and
//! in code, `use crate::{a, b::c}` groups included) is an edge from its module to `y`
//! (or to the crate root, when `y` is not a module but an item of `main.rs`/`lib.rs`).
//!
//! The check fails on
//! - a module missing from [`CRATES`], so the table is kept up to date;
//! - any cycle between modules, printed with one `file:line` per edge;
//! - a module that uses one above it in [`CRATES`], or one after it on its own line
//!   (the order inside a line is the order: `tcp` may use nothing of `http`).
//!
//! Only `crate::` paths are followed: `super::` paths that climb out of a module are not
//! (the crate uses `crate::` for those).

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    fmt,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

/// The modules of each crate that holds several, bottom first: a module may use the
/// modules of the lines below its own, and those before it on its own line. Between
/// crates Cargo keeps the order (a crate can only use its dependencies); inside a crate
/// only this table does.
pub const CRATES: &[(&str, Layers)] = &[
    (
        "proxy/crates/core/src",
        &[
            &[
                "proto",
                "interned",
                "stats",
                "event",
                "stream_info",
                "access_log",
                "formatter",
                "set_filter_state",
                "peer",
                "istio_stats",
            ],
            &["lib"],
        ],
    ),
    (
        "proxy/crates/filters/src",
        &[
            &["common"],
            &["tracers"],
            &["tcp", "network", "http"],
            &["lib"],
        ],
    ),
    (
        "proxy/crates/xds/src",
        &[
            &["snapshot", "wire", "grpc"],
            &["type_url", "source", "local", "stream", "manager"],
            &["lib"],
        ],
    ),
    (
        "capture/src",
        &[
            &["config", "netns", "link", "bpffs", "iptables", "pod_names"],
            &["ebpf", "kernel_log", "node", "events", "explain", "state"],
            &["inspect", "lib"],
        ],
    ),
    ("proxy/src", &[&["server"], &["main", "lib"]]),
];

/// A crate's layers, bottom first.
pub type Layers = &'static [&'static [&'static str]];

/// Where `module` stands in `layers`: (layer, place on its line), or `None` if it is
/// not in the table.
pub fn rank(module: &str, layers: Layers) -> Option<(usize, usize)> {
    layers.iter().enumerate().find_map(|(layer, line)| {
        line.iter()
            .position(|m| *m == module)
            .map(|place| (layer, place))
    })
}

/// Checks every crate of [`CRATES`].
pub fn check_all() -> Result<Vec<Report>> {
    CRATES
        .iter()
        .map(|(src, _)| check_dir(&crate::workspace_root().join(src)))
        .collect()
}

/// The layers of the crate whose `src/` is `src`.
fn layers_of(src: &Path) -> Result<Layers> {
    let root = crate::workspace_root();
    CRATES
        .iter()
        .find(|(dir, _)| root.join(dir) == src || Path::new(dir) == src)
        .map(|(_, layers)| *layers)
        .with_context(|| {
            format!(
                "{} is not in the layer table: add it to CRATES in xtask/src/layers.rs",
                src.display()
            )
        })
}

/// One source file, already read.
pub struct Source {
    /// As printed: `proxy/src/tcp/mod.rs`.
    pub path: String,
    /// The top-level module it belongs to (`tcp`; `main` for `main.rs`).
    pub module: String,
    /// The crate root it belongs to (`main` or `lib`): where `crate::ITEM` goes when
    /// `ITEM` is not a top-level module.
    pub root: String,
    pub text: String,
}

/// A place an edge was seen.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Site {
    pub path: String,
    pub line: usize,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.path, self.line)
    }
}

pub struct Report {
    pub root: String,
    pub modules: Vec<String>,
    /// (from, to) -> every place `from` uses `to`.
    pub edges: BTreeMap<(String, String), Vec<Site>>,
    pub problems: Vec<String>,
}

impl Report {
    pub fn summary(&self) -> String {
        format!(
            "{} modules, {} edges between them",
            self.modules.len(),
            self.edges.len()
        )
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.problems.is_empty() {
            return write!(f, "layer check of {}: ok ({})", self.root, self.summary());
        }
        writeln!(
            f,
            "layer check of {}: {} problem(s) ({}; the layers are in xtask/src/layers.rs)",
            self.root,
            self.problems.len(),
            self.summary()
        )?;
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// Reads `src` (a crate's `src/`) and checks it.
pub fn check_dir(src: &Path) -> Result<Report> {
    let layers = layers_of(src)?;
    // Paths as from the repository's root: `proxy/src/tcp/mod.rs`.
    let repo = src.parent().and_then(Path::parent).unwrap_or(src);
    let shown = |p: &Path| {
        p.strip_prefix(crate::workspace_root())
            .or_else(|_| p.strip_prefix(repo))
            .unwrap_or(p)
            .display()
            .to_string()
    };
    let mut modules = Vec::new();
    let mut sources = Vec::new();
    for root in ["main", "lib"] {
        let root_file = src.join(format!("{root}.rs"));
        if !root_file.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&root_file)
            .with_context(|| format!("reading {}", root_file.display()))?;
        modules.push((root.to_string(), shown(&root_file)));
        for name in declared_modules(&text) {
            let file = src.join(format!("{name}.rs"));
            let dir = src.join(&name);
            let mut files = Vec::new();
            if file.is_file() {
                files.push(file.clone());
            }
            if dir.is_dir() {
                rs_files(&dir, &mut files)?;
            }
            let place = if dir.is_dir() {
                format!("{}/", shown(&dir))
            } else {
                shown(&file)
            };
            modules.push((name.clone(), place));
            for f in files {
                sources.push(Source {
                    path: shown(&f),
                    module: name.clone(),
                    root: root.into(),
                    text: std::fs::read_to_string(&f)
                        .with_context(|| format!("reading {}", f.display()))?,
                });
            }
        }
        sources.push(Source {
            path: shown(&root_file),
            module: root.into(),
            root: root.into(),
            text,
        });
    }
    anyhow::ensure!(
        !modules.is_empty(),
        "{} has neither main.rs nor lib.rs",
        src.display()
    );
    let mut report = check(&modules, &sources, layers);
    report.root = shown(src);
    Ok(report)
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        if path.is_dir() {
            rs_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The `mod x;` declarations of a crate root (with any visibility and attributes).
pub fn declared_modules(root_text: &str) -> Vec<String> {
    let clean = blank_comments_and_strings(root_text);
    let b = clean.as_bytes();
    let mut names = Vec::new();
    let mut from = 0;
    while let Some(found) = clean[from..].find("mod") {
        let at = from + found;
        from = at + 3;
        let word_start = at == 0 || !(b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_');
        if !word_start || !b.get(from).is_some_and(|c| c.is_ascii_whitespace()) {
            continue;
        }
        let p = skip_ws(b, from);
        let Some(name) = ident_at(b, p) else { continue };
        // `mod x;` is a file; `mod x { .. }` is inline.
        if b.get(skip_ws(b, p + name.len())) == Some(&b';') {
            names.push(name);
        }
    }
    names
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Checks the sources of `modules` (name, where it is: for the messages).
pub fn check(modules: &[(String, String)], sources: &[Source], layers: Layers) -> Report {
    let names: BTreeSet<&str> = modules.iter().map(|(n, _)| n.as_str()).collect();
    let mut edges: BTreeMap<(String, String), Vec<Site>> = BTreeMap::new();
    for src in sources {
        for (target, line) in crate_references(&src.text) {
            let to = if names.contains(target.as_str()) {
                target
            } else {
                src.root.clone()
            };
            if to == src.module {
                continue;
            }
            edges
                .entry((src.module.clone(), to))
                .or_default()
                .push(Site {
                    path: src.path.clone(),
                    line,
                });
        }
    }
    let mut problems = Vec::new();
    for (name, place) in modules {
        if rank(name, layers).is_none() {
            problems.push(format!(
                "module {name} ({place}) is not in the layer table: add it to CRATES in xtask/src/layers.rs"
            ));
        }
    }
    problems.extend(cycles(&edges));
    for ((from, to), sites) in &edges {
        let (Some(rf), Some(rt)) = (rank(from, layers), rank(to, layers)) else {
            continue;
        };
        if rt < rf {
            continue;
        }
        let what = if rt.0 == rf.0 {
            format!(
                "{from} uses {to}, which comes after it on its own layer {} ({})",
                rf.0 + 1,
                layers[rf.0].join(" < ")
            )
        } else {
            format!(
                "{from} (layer {}) uses {to} (layer {}), a layer above it",
                rf.0 + 1,
                rt.0 + 1
            )
        };
        problems.push(format!("upward use: {what}: {}", sites_text(sites)));
    }
    Report {
        root: String::new(),
        modules: modules.iter().map(|(n, _)| n.clone()).collect(),
        edges,
        problems,
    }
}

/// The first three places, and how many more there are.
fn sites_text(sites: &[Site]) -> String {
    let shown: Vec<String> = sites.iter().take(3).map(Site::to_string).collect();
    match sites.len() {
        n if n > 3 => format!("{} (and {} more)", shown.join(", "), n - 3),
        _ => shown.join(", "),
    }
}

/// One problem per strongly connected component of more than one module: its members,
/// then the shortest cycle through each member (repeats left out), each edge with an
/// example `file:line`.
fn cycles(edges: &BTreeMap<(String, String), Vec<Site>>) -> Vec<String> {
    let mut graph: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        graph.entry(from).or_default().push(to);
        graph.entry(to).or_default();
    }
    let mut problems = Vec::new();
    for component in strongly_connected(&graph) {
        if component.len() < 2 {
            continue;
        }
        let members: BTreeSet<&str> = component.iter().copied().collect();
        let mut seen: BTreeSet<Vec<&str>> = BTreeSet::new();
        let mut text = format!(
            "cycle between modules {}:",
            members.iter().copied().collect::<Vec<_>>().join(", ")
        );
        for &start in &members {
            let Some(cycle) = shortest_cycle(&graph, &members, start) else {
                continue;
            };
            // The same cycle found from another of its members: rotate to compare.
            let min = (0..cycle.len())
                .min_by_key(|&i| cycle[i])
                .expect("a cycle has members");
            let canonical: Vec<&str> = cycle[min..].iter().chain(&cycle[..min]).copied().collect();
            if !seen.insert(canonical) {
                continue;
            }
            let mut path = cycle.clone();
            path.push(cycle[0]);
            text.push_str(&format!("\n  {}", path.join(" -> ")));
            for pair in path.windows(2) {
                let sites = &edges[&(pair[0].to_string(), pair[1].to_string())];
                text.push_str(&format!(
                    "\n    {} -> {}: {}",
                    pair[0],
                    pair[1],
                    sites_text(sites)
                ));
            }
        }
        problems.push(text);
    }
    problems
}

/// Tarjan's algorithm.
fn strongly_connected<'a>(graph: &BTreeMap<&'a str, Vec<&'a str>>) -> Vec<Vec<&'a str>> {
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(v: &'a str, graph: &BTreeMap<&'a str, Vec<&'a str>>, s: &mut State<'a>) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for &w in &graph[v] {
            if !s.index.contains_key(w) {
                visit(w, graph, s);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                component.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let mut s = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(v, graph, &mut s);
        }
    }
    s.out
}

/// The shortest cycle from `start` back to it inside `members` (breadth first).
fn shortest_cycle<'a>(
    graph: &BTreeMap<&'a str, Vec<&'a str>>,
    members: &BTreeSet<&'a str>,
    start: &'a str,
) -> Option<Vec<&'a str>> {
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &w in &graph[v] {
            if !members.contains(w) {
                continue;
            }
            if w == start {
                let mut cycle = vec![v];
                let mut at = v;
                while at != start {
                    at = parent[at];
                    cycle.push(at);
                }
                cycle.reverse();
                return Some(cycle);
            }
            if w != start && !parent.contains_key(w) {
                parent.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    None
}

/// Every `crate::NAME` in `text` (code only), with its line: `NAME` is the first segment
/// after `crate::`, or each first segment of a `crate::{..}` group.
pub fn crate_references(text: &str) -> Vec<(String, usize)> {
    let clean = blank_comments_and_strings(text);
    let b = clean.as_bytes();
    let line_of = |pos: usize| 1 + b[..pos].iter().filter(|&&c| c == b'\n').count();
    let is_ident_byte = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = clean[from..].find("crate") {
        let at = from + found;
        from = at + "crate".len();
        if at > 0 && is_ident_byte(b[at - 1]) {
            continue;
        }
        let mut p = skip_ws(b, from);
        if !b[p..].starts_with(b"::") {
            continue;
        }
        p = skip_ws(b, p + 2);
        if b.get(p) == Some(&b'{') {
            let (heads, _) = group_heads(b, p);
            out.extend(heads.into_iter().map(|(name, pos)| (name, line_of(pos))));
        } else if let Some(name) = ident_at(b, p) {
            out.push((name, line_of(p)));
        }
    }
    out
}

fn skip_ws(b: &[u8], mut p: usize) -> usize {
    while p < b.len() && b[p].is_ascii_whitespace() {
        p += 1;
    }
    p
}

fn ident_at(b: &[u8], p: usize) -> Option<String> {
    let end = p + b[p..]
        .iter()
        .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_')
        .count();
    let name = std::str::from_utf8(&b[p..end]).ok()?;
    (is_ident(name) && name != "self").then(|| name.to_string())
}

/// The first segment of each item of the `{...}` group at `open`, and where the group
/// ends.
fn group_heads(b: &[u8], open: usize) -> (Vec<(String, usize)>, usize) {
    let mut heads = Vec::new();
    let mut p = open + 1;
    loop {
        p = skip_ws(b, p);
        match b.get(p) {
            None => return (heads, p),
            Some(b'}') => return (heads, p + 1),
            Some(b',') => {
                p += 1;
                continue;
            }
            Some(b'{') => {
                let (inner, end) = group_heads(b, p);
                heads.extend(inner);
                p = end;
            }
            Some(_) => {
                if let Some(name) = ident_at(b, p) {
                    heads.push((name, p));
                }
            }
        }
        // The rest of this item, up to its ',' or the group's '}'.
        let mut depth = 0usize;
        while let Some(&c) = b.get(p) {
            match c {
                b'{' => depth += 1,
                b'}' if depth == 0 => break,
                b'}' => depth -= 1,
                b',' if depth == 0 => break,
                _ => {}
            }
            p += 1;
        }
    }
}

/// `text` with comments (line, doc and nested block comments) and the insides of string
/// and character literals replaced by spaces; line breaks are kept, so lines still count.
pub fn blank_comments_and_strings(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |n| i + n);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                let mut j = i;
                while j < b.len() {
                    if b[j..].starts_with(b"/*") {
                        depth += 1;
                        j += 2;
                    } else if b[j..].starts_with(b"*/") {
                        depth -= 1;
                        j += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        j += 1;
                    }
                }
                blank(&mut out, i, j);
                i = j;
            }
            // r"..", r#".."#, br#".."#
            b'r' if (i == 0
                || !ident(b[i - 1])
                || (b[i - 1] == b'b' && (i < 2 || !ident(b[i - 2]))))
                && matches!(b.get(i + 1), Some(b'"' | b'#')) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let body = i + 2 + hashes;
                let mut close = vec![b'"'];
                close.extend(std::iter::repeat_n(b'#', hashes));
                let end = b[body..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |n| body + n);
                blank(&mut out, body, end);
                i = end + close.len();
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i + 1, j);
                i = j + 1;
            }
            b'\'' => {
                // '\n', '\'', '\u{..}' | 'x' | a lifetime 'a (left alone).
                if b.get(i + 1) == Some(&b'\\') {
                    let mut j = i + 2;
                    while j < b.len() && b[j] != b'\'' {
                        j += 1;
                    }
                    // '\'' : the quote right after the backslash is the character.
                    if j == i + 2 {
                        j = i + 3;
                    }
                    blank(&mut out, i + 1, j);
                    i = j + 1;
                } else if let Some(len) = text[i + 1..].chars().next().map(char::len_utf8)
                    && b.get(i + 1 + len) == Some(&b'\'')
                {
                    blank(&mut out, i + 1, i + 1 + len);
                    i += 2 + len;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced, whole characters at a time")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table for the tests.
    const LAYERS: Layers = &[
        &["memory", "stats", "event", "config"],
        &["tls"],
        &["upstream"],
        &["tcp", "http", "network", "dns"],
        &["listener"],
        &["main", "lib"],
    ];

    fn check(modules: &[(String, String)], sources: &[Source]) -> Report {
        super::check(modules, sources, LAYERS)
    }

    fn rank(module: &str) -> Option<(usize, usize)> {
        super::rank(module, LAYERS)
    }

    fn src(module: &str, text: &str) -> Source {
        Source {
            path: format!("src/{module}.rs"),
            module: module.into(),
            root: "main".into(),
            text: text.into(),
        }
    }

    fn modules(names: &[&str]) -> Vec<(String, String)> {
        names
            .iter()
            .map(|n| (n.to_string(), format!("src/{n}.rs")))
            .collect()
    }

    #[test]
    fn each_crate_table_has_each_module_once() {
        for (src, layers) in CRATES {
            let all: Vec<&str> = layers.iter().flat_map(|l| l.iter().copied()).collect();
            let unique: BTreeSet<&str> = all.iter().copied().collect();
            assert_eq!(all.len(), unique.len(), "{src}");
        }
        assert_eq!(rank("stats"), Some((0, 1)));
        assert_eq!(rank("http"), Some((3, 1)));
        assert_eq!(rank("capture"), None);
    }

    #[test]
    fn a_downward_use_is_fine() {
        let r = check(
            &modules(&["tls", "config", "main"]),
            &[
                src(
                    "tls",
                    "use crate::config::Cluster;\nfn f() { crate::config::load(); }",
                ),
                src("main", "use crate::tls;"),
            ],
        );
        assert!(r.problems.is_empty(), "{r}");
        assert_eq!(r.edges.len(), 2);
    }

    #[test]
    fn a_cycle_is_named_with_a_place_per_edge() {
        let r = check(
            &modules(&["tcp", "http", "upstream"]),
            &[
                src("tcp", "\nuse crate::http::Codec;\n"),
                src("http", "fn f() {\n    crate::upstream::pick();\n}\n"),
                src("upstream", "use crate::tcp;\n"),
            ],
        );
        let text = r.to_string();
        let cycle = r
            .problems
            .iter()
            .find(|p| p.starts_with("cycle"))
            .unwrap_or_else(|| panic!("no cycle found:\n{text}"));
        assert!(
            cycle.contains("cycle between modules http, tcp, upstream"),
            "{cycle}"
        );
        assert!(cycle.contains("http -> upstream -> tcp -> http"), "{cycle}");
        assert!(cycle.contains("tcp -> http: src/tcp.rs:2"), "{cycle}");
        assert!(cycle.contains("http -> upstream: src/http.rs:2"), "{cycle}");
        assert!(
            cycle.contains("upstream -> tcp: src/upstream.rs:1"),
            "{cycle}"
        );
    }

    #[test]
    fn an_upward_use_fails_and_so_does_a_later_one_on_the_same_line() {
        let r = check(
            &modules(&["tls", "upstream", "tcp", "http"]),
            &[
                src("tls", "use crate::upstream::Host;\n"),
                src("tcp", "use crate::http;\n"),
            ],
        );
        assert_eq!(r.problems.len(), 2, "{r}");
        assert!(
            r.problems.iter().any(|p| p
                == "upward use: tls (layer 2) uses upstream (layer 3), a layer above it: src/tls.rs:1"),
            "{r}"
        );
        assert!(
            r.problems.iter().any(|p| p.starts_with(
                "upward use: tcp uses http, which comes after it on its own layer 4 (tcp < http <"
            ) && p.ends_with("): src/tcp.rs:1")),
            "{r}"
        );
        // The other way round is fine.
        let r = check(
            &modules(&["tcp", "http"]),
            &[src("http", "use crate::tcp;\n")],
        );
        assert!(r.problems.is_empty(), "{r}");
    }

    #[test]
    fn grouped_uses_count_each_module() {
        let text = "use crate::{\n    config::{self, Bootstrap},\n    stats,\n    {tls::Ctx, upstream::Pool},\n    self,\n};\n";
        let refs = crate_references(text);
        let names: Vec<&str> = refs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["config", "stats", "tls", "upstream"]);
        let lines: Vec<usize> = refs.iter().map(|(_, l)| *l).collect();
        assert_eq!(lines, [2, 3, 4, 4]);
        let r = check(
            &modules(&["config", "stats", "tls", "upstream", "listener"]),
            &[src("listener", text)],
        );
        assert!(r.problems.is_empty(), "{r}");
        assert_eq!(r.edges.len(), 4);
    }

    #[test]
    fn comments_strings_and_lookalikes_are_not_uses() {
        let text = r###"
            // crate::http is mentioned here
            /// see [`crate::http::Codec`]
            //! and crate::http
            /* crate::http /* nested crate::http */ crate::http */
            const S: &str = "crate::http";
            const R: &str = r#"crate::http "quoted" "#;
            const C: char = '"'; const Q: char = '\'';
            fn f<'a>(x: &'a str) -> &'a str { x }
            pub(crate) fn g() {}
            let notcrate::http = 1;
            use crate::config;
        "###;
        let refs = crate_references(text);
        assert_eq!(refs, [("config".to_string(), 12)]);
    }

    #[test]
    fn unknown_modules_and_crate_root_items() {
        let r = check(
            &modules(&["capture", "tcp", "main"]),
            &[src(
                "tcp",
                "use crate::capture::x;\nfn f() { crate::VERSION; }\n",
            )],
        );
        let text = r.to_string();
        assert!(
            text.contains("module capture (src/capture.rs) is not in the layer table"),
            "{text}"
        );
        // crate::VERSION is an item of main.rs: tcp uses main, above it.
        assert!(
            text.contains("tcp (layer 4) uses main (layer 6), a layer above it: src/tcp.rs:2"),
            "{text}"
        );
    }

    #[test]
    fn declared_modules_of_a_root() {
        let root = "//! doc\n#[cfg(test)]\nmod tests;\npub mod a;\npub(crate) mod b;\nmod inline { }\n// mod c;\nuse x;\nfn main() {}\n";
        assert_eq!(declared_modules(root), ["tests", "a", "b"]);
    }
}
