//! Loading a bootstrap the way Envoy's command line does: `-c FILE` (JSON or YAML, by
//! extension or else by content; `.pb` is binary protobuf), `--config-yaml` merged over it
//! with protobuf merge semantics, then `--service-node` / `--service-cluster` written into
//! `node`. Every error names its origin (the file, or `--config-yaml`) and, for content,
//! the JSON path inside it.

use std::path::{Path, PathBuf};

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use prost::Message;
use serde_json::Value;

use super::diagnostic::{Diagnostic, Severity};
use super::json::{self, JsonError, Leniency};

/// What the command line says about the bootstrap (Envoy's server options).
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// `-c/--config-path`.
    pub config_path: Option<PathBuf>,
    /// `--config-yaml`, merged over the file.
    pub config_yaml: Option<String>,
    /// `--service-node`: overrides `node.id`.
    pub service_node: Option<String>,
    /// `--service-cluster`: overrides `node.cluster`.
    pub service_cluster: Option<String>,
    /// `--drain-time-s`.
    pub drain_time: std::time::Duration,
    /// `--parent-shutdown-time-s`.
    pub parent_shutdown_time: std::time::Duration,
}

impl Options {
    /// Whether the command line names a bootstrap at all.
    pub fn has_bootstrap(&self) -> bool {
        self.config_path.is_some() || self.config_yaml.is_some()
    }

    /// How the bootstrap is named in messages.
    pub fn origin(&self) -> String {
        match (&self.config_path, &self.config_yaml) {
            (Some(path), None) => path.display().to_string(),
            (Some(path), Some(_)) => format!("{} with --config-yaml", path.display()),
            (None, Some(_)) => "--config-yaml".into(),
            (None, None) => "no bootstrap".into(),
        }
    }
}

/// A bootstrap as loaded, with what loading accepted but wants to warn about.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub bootstrap: Bootstrap,
    pub findings: Vec<Diagnostic>,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("no bootstrap: give -c/--config-path FILE or --config-yaml STRING")]
    NoBootstrap,
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Not JSON or YAML at all; `message` has the line and column.
    #[error("{origin}: {message}")]
    Syntax { origin: String, message: String },
    /// Well-formed, but not a valid bootstrap.
    #[error("{origin}: {error}")]
    Content { origin: String, error: JsonError },
}

/// The formats a bootstrap file can be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Yaml,
    /// Binary protobuf (`.pb`).
    Binary,
}

impl Format {
    /// By extension as Envoy does; an unknown extension is JSON if the text starts with
    /// `{` and YAML otherwise (YAML is a superset, but serde_json's errors are clearer).
    fn of(path: &Path, bytes: &[u8]) -> Format {
        match path.extension().and_then(|ext| ext.to_str()) {
            Some("json") => Format::Json,
            Some("yaml" | "yml") => Format::Yaml,
            Some("pb") => Format::Binary,
            _ if bytes.trim_ascii_start().starts_with(b"{") => Format::Json,
            _ => Format::Yaml,
        }
    }
}

/// Loads the bootstrap the options name.
pub fn load(options: &Options) -> Result<Loaded, LoadError> {
    let mut findings = Vec::new();
    let mut bootstrap = match &options.config_path {
        Some(path) => Some(load_file(path, &mut findings)?),
        None => None,
    };
    if let Some(yaml) = &options.config_yaml {
        let overlay = parse(
            yaml.as_bytes(),
            Format::Yaml,
            "--config-yaml",
            &mut findings,
        )?;
        bootstrap = Some(match bootstrap {
            Some(base) => merge(base, &overlay).map_err(|err| LoadError::Syntax {
                origin: options.origin(),
                message: format!("merging --config-yaml: {err}"),
            })?,
            None => overlay,
        });
    }
    let mut bootstrap = bootstrap.ok_or(LoadError::NoBootstrap)?;
    if let Some(id) = &options.service_node {
        bootstrap.node.get_or_insert_with(Default::default).id = id.clone();
    }
    if let Some(cluster) = &options.service_cluster {
        bootstrap.node.get_or_insert_with(Default::default).cluster = cluster.clone();
    }
    Ok(Loaded {
        bootstrap,
        findings,
    })
}

/// Loads one bootstrap file.
pub fn load_file(path: &Path, findings: &mut Vec<Diagnostic>) -> Result<Bootstrap, LoadError> {
    let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    let origin = path.display().to_string();
    parse(&bytes, Format::of(path, &bytes), &origin, findings)
}

/// Parses a bootstrap document; `origin` names it in errors and findings.
pub fn parse(
    bytes: &[u8],
    format: Format,
    origin: &str,
    findings: &mut Vec<Diagnostic>,
) -> Result<Bootstrap, LoadError> {
    let syntax = |message: String| LoadError::Syntax {
        origin: origin.to_owned(),
        message,
    };
    let value = match format {
        Format::Binary => {
            return Bootstrap::decode(bytes)
                .map_err(|err| syntax(format!("not a binary Bootstrap: {err}")));
        }
        Format::Json => serde_json::from_slice::<Value>(bytes)
            .map_err(|err| syntax(format!("invalid JSON: {err}")))?,
        Format::Yaml => {
            let text =
                std::str::from_utf8(bytes).map_err(|err| syntax(format!("not UTF-8: {err}")))?;
            yaml_to_json(text).map_err(syntax)?
        }
    };
    match value {
        Value::Object(_) => {}
        Value::Null => return Err(syntax("the bootstrap is empty".into())),
        _ => return Err(syntax("the bootstrap must be an object (a map)".into())),
    }
    let (bootstrap, leniencies) =
        json::from_json::<Bootstrap>(value).map_err(|error| LoadError::Content {
            origin: origin.to_owned(),
            error,
        })?;
    findings.extend(
        leniencies
            .into_iter()
            .map(|Leniency { path, message }| Diagnostic {
                severity: Severity::Warning,
                path,
                message: format!("{message} (in {origin})"),
            }),
    );
    Ok(bootstrap)
}

/// `overlay` merged into `base` as protobuf's `MergeFrom` (what Envoy does with
/// `--config-yaml`): set scalars replace, messages merge, lists append. Decoding the
/// overlay's bytes on top of the base is exactly that merge.
fn merge(mut base: Bootstrap, overlay: &Bootstrap) -> Result<Bootstrap, prost::DecodeError> {
    base.merge(overlay.encode_to_vec().as_slice())?;
    Ok(base)
}

/// YAML as Envoy reads it: anchors, aliases and `<<` merge keys resolved, map entries
/// whose key is tagged `!ignore` dropped (Envoy's way to hold anchors outside the schema),
/// scalar map keys as strings. One document only.
fn yaml_to_json(text: &str) -> Result<Value, String> {
    if let Some((line, column)) = flow_nesting_beyond(text, MAX_YAML_FLOW_DEPTH) {
        return Err(format!(
            "invalid YAML: flow collections ([...] or {{...}}) nested deeper than \
             {MAX_YAML_FLOW_DEPTH} levels at line {line} column {column}"
        ));
    }
    let mut value: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).map_err(|err| format!("invalid YAML: {err}"))?;
    value
        .apply_merge()
        .map_err(|err| format!("invalid YAML merge key: {err}"))?;
    convert_yaml(value, &mut Vec::new())?.ok_or_else(|| "the whole document is !ignore".into())
}

/// How deep `[...]` and `{...}` may nest in a YAML bootstrap. The YAML parser's time grows
/// with the square of that depth (each token looks at every open level), so a deeper
/// document is refused before it is parsed; its value parser refuses more than 128
/// levels of any kind anyway, as serde_json does for JSON.
pub const MAX_YAML_FLOW_DEPTH: usize = 128;

/// Where (1-based line and column) flow collections in `text` first nest deeper than
/// `limit`, in one pass. It errs on the side of counting: inside a flow collection every
/// `[` or `{` counts (libyaml ends a plain scalar there and opens a collection); outside,
/// one counts where a node can start (at the start of a line, after `- `, `: `, `? `, or
/// after a node property: a tag `!t ` or an anchor `&a `). Quoted scalars and comments
/// open nothing, nor do brackets inside a block-context plain scalar: `^[a-z]+$`, `"[["`.
fn flow_nesting_beyond(text: &str, limit: usize) -> Option<(usize, usize)> {
    let mut depth = 0usize;
    // The last significant character, and whether blanks came after it; `None` at the
    // start of a block-context line.
    let mut prev: Option<char> = None;
    let mut blank = false;
    let (mut line, mut column) = (1usize, 0usize);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        column += 1;
        if c == '\n' {
            line += 1;
            column = 0;
            blank = true;
            if depth == 0 {
                prev = None;
            }
            continue;
        }
        if c == ' ' || c == '\t' || c == '\r' {
            blank = true;
            continue;
        }
        let token_start = match prev {
            None => true,
            Some('[' | '{' | ',') => true,
            Some(':') => blank || depth > 0,
            // `!` stands for any node property (tag or anchor) just read.
            Some('-' | '?' | '!') => blank,
            Some(_) => false,
        };
        if c == '#' && (blank || prev.is_none()) {
            // A comment, to the end of the line.
            while chars.next_if(|&c| c != '\n').is_some() {}
            continue;
        }
        if token_start && (c == '\'' || c == '"') {
            // A quoted scalar, to its closing quote ('' and \" are escapes).
            while let Some(q) = chars.next() {
                column += 1;
                if q == '\n' {
                    line += 1;
                    column = 0;
                } else if c == '"' && q == '\\' {
                    chars.next();
                    column += 1;
                } else if q == c {
                    if c == '\'' && chars.next_if_eq(&'\'').is_some() {
                        column += 1;
                        continue;
                    }
                    break;
                }
            }
        } else if token_start && (c == '!' || c == '&') {
            // A node property, to the next blank: what follows it starts the node.
            while chars
                .next_if(|&c| !matches!(c, ' ' | '\t' | '\r' | '\n'))
                .is_some()
            {
                column += 1;
            }
            prev = Some('!');
            blank = false;
            continue;
        } else if (token_start || depth > 0) && (c == '[' || c == '{') {
            depth += 1;
            if depth > limit {
                return Some((line, column));
            }
        } else if (c == ']' || c == '}') && depth > 0 {
            depth -= 1;
        }
        // Only indicators matter to what follows; anything else is inside a scalar.
        prev = Some(match c {
            '[' | '{' if token_start || depth > 0 => c,
            ',' if depth > 0 => c,
            ':' | '-' | '?' => c,
            _ => 'a',
        });
        blank = false;
    }
    None
}

/// `None` for a value tagged `!ignore`.
fn convert_yaml(
    value: serde_yaml_ng::Value,
    path: &mut Vec<String>,
) -> Result<Option<Value>, String> {
    use serde_yaml_ng::Value as Yaml;
    let at = |path: &Vec<String>| {
        if path.is_empty() {
            "the document".to_owned()
        } else {
            path.join(".")
        }
    };
    Ok(Some(match value {
        Yaml::Null => Value::Null,
        Yaml::Bool(b) => Value::Bool(b),
        Yaml::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                // Proto3 JSON spells the non-finite doubles as strings.
                serde_json::Number::from_f64(f).map_or_else(
                    || {
                        Value::String(
                            if f.is_nan() {
                                "NaN"
                            } else if f > 0.0 {
                                "Infinity"
                            } else {
                                "-Infinity"
                            }
                            .into(),
                        )
                    },
                    Value::Number,
                )
            }
        }
        Yaml::String(s) => Value::String(s),
        Yaml::Sequence(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (index, item) in items.into_iter().enumerate() {
                path.push(format!("[{index}]"));
                let converted = convert_yaml(item, path)?;
                path.pop();
                out.extend(converted);
            }
            Value::Array(out)
        }
        Yaml::Mapping(entries) => {
            let mut out = serde_json::Map::with_capacity(entries.len());
            for (key, item) in entries {
                let key = match key {
                    Yaml::Tagged(tagged) if tagged.tag == "!ignore" => continue,
                    Yaml::String(s) => s,
                    Yaml::Number(n) => n.to_string(),
                    Yaml::Bool(b) => b.to_string(),
                    other => {
                        return Err(format!(
                            "{}: a map key must be a scalar, found {other:?}",
                            at(path)
                        ));
                    }
                };
                path.push(key.clone());
                let converted = convert_yaml(item, path)?;
                path.pop();
                if let Some(converted) = converted {
                    out.insert(key, converted);
                }
            }
            Value::Object(out)
        }
        Yaml::Tagged(tagged) if tagged.tag == "!ignore" => return Ok(None),
        Yaml::Tagged(tagged) => {
            return Err(format!(
                "{}: YAML tag {} is not supported (only !ignore is)",
                at(path),
                tagged.tag
            ));
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_yaml(text: &str) -> Result<Bootstrap, LoadError> {
        parse(text.as_bytes(), Format::Yaml, "test.yaml", &mut Vec::new())
    }

    #[test]
    fn yaml_anchors_merge_keys_and_ignore_work_as_in_envoy() {
        let bootstrap = parse_yaml(
            r#"
!ignore defaults: &timeout
  connect_timeout: 2s
static_resources:
  clusters:
  - <<: *timeout
    name: a
  - <<: *timeout
    name: b
    connect_timeout: 3s
"#,
        )
        .unwrap();
        let clusters = bootstrap.static_resources.unwrap().clusters;
        assert_eq!(clusters[0].connect_timeout.unwrap().seconds, 2);
        assert_eq!(clusters[1].connect_timeout.unwrap().seconds, 3);
    }

    #[test]
    fn deep_flow_nesting_is_refused_before_parsing_with_the_limit_and_where() {
        // 100,000 levels took the YAML parser minutes (quadratic); the scan is linear.
        for (open, close) in [("{a: ", "}"), ("[", "]"), ("[a: ", "]")] {
            let levels = 100_000;
            let text = format!(
                "admin:\n  address: {}{}\n",
                open.repeat(levels),
                close.repeat(levels)
            );
            let err = parse_yaml(&text).unwrap_err().to_string();
            let column = 12 + MAX_YAML_FLOW_DEPTH * open.len();
            assert_eq!(
                err,
                format!(
                    "test.yaml: invalid YAML: flow collections ([...] or {{...}}) nested deeper \
                     than 128 levels at line 2 column {column}"
                ),
                "{open}"
            );
        }
    }

    #[test]
    fn flow_nesting_counts_only_collections() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(flow_nesting_beyond(&deep(128), 128), None);
        assert_eq!(flow_nesting_beyond(&deep(129), 128), Some((1, 129)));
        let brackets = "[".repeat(200);
        for text in [
            format!("a: \"{brackets}\"\nb: [x]"),
            format!("a: '{brackets}'' {brackets}'\nb: [x]"),
            format!("a: ^{brackets}$\nb: [x]"),
            format!("# {brackets}\nb: [x]"),
            format!("a: [\"]{brackets}\", '{brackets}']"),
        ] {
            assert_eq!(flow_nesting_beyond(&text, 128), None, "{text}");
        }
        // A node property (tag, anchor, or both) before a collection does not hide it,
        // nor does a plain scalar before a bracket inside a flow collection.
        for prefix in ["!t ", "&a ", "!t &a ", "!!seq ", "&a\t", "!<tag:x> "] {
            let text = format!("a: {}1", format!("{prefix}[").repeat(129));
            assert!(flow_nesting_beyond(&text, 128).is_some(), "{prefix}");
            let text = format!("- {}1", format!("{prefix}{{k: ").repeat(129));
            assert!(flow_nesting_beyond(&text, 128).is_some(), "{prefix}");
        }
        assert!(flow_nesting_beyond(&format!("a: [{}", "x[".repeat(129)), 128).is_some());
        assert_eq!(
            flow_nesting_beyond(&format!("a: !t ['{brackets}', !t \"{brackets}\"]"), 128),
            None
        );
        // A regex in a route with brackets still loads.
        parse_yaml("node: {id: \"a[b\", cluster: '[[['}\n").unwrap();
    }

    #[test]
    fn integer_map_keys_become_strings() {
        let bootstrap = parse_yaml("node:\n  metadata:\n    8000: port\n").unwrap();
        let metadata = bootstrap.node.unwrap().metadata.unwrap();
        assert!(metadata.fields.contains_key("8000"));
    }

    #[test]
    fn yaml_syntax_errors_name_the_file_and_line() {
        let err = parse_yaml("admin:\n  address: [\n")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("test.yaml: invalid YAML: "), "{err}");
        assert!(err.contains("line"), "{err}");
    }

    #[test]
    fn content_errors_name_the_file_and_the_path() {
        let err =
            parse_yaml("static_resources:\n  clusters:\n  - name: a\n    connect_timeout: 5\n")
                .unwrap_err()
                .to_string();
        assert!(
            err.starts_with(
                "test.yaml: static_resources.clusters[0].connect_timeout: invalid duration 5"
            ),
            "{err}"
        );
    }

    #[test]
    fn config_yaml_merges_over_the_file_as_protobuf_merge() {
        let dir = std::env::temp_dir().join(format!("shunt-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("base.json");
        std::fs::write(
            &file,
            r#"{"node": {"id": "from-file", "cluster": "c"},
                "static_resources": {"clusters": [{"name": "a"}]}}"#,
        )
        .unwrap();
        let loaded = load(&Options {
            config_path: Some(file.clone()),
            config_yaml: Some(
                "node: {id: from-flag}\nstatic_resources: {clusters: [{name: b}]}".into(),
            ),
            service_cluster: Some("from-service-cluster".into()),
            ..Default::default()
        })
        .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let node = loaded.bootstrap.node.unwrap();
        assert_eq!(node.id, "from-flag");
        assert_eq!(node.cluster, "from-service-cluster");
        let names: Vec<_> = loaded
            .bootstrap
            .static_resources
            .unwrap()
            .clusters
            .into_iter()
            .map(|c| c.name)
            .collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn service_node_overrides_the_bootstrap() {
        let loaded = load(&Options {
            config_yaml: Some("node: {id: in-yaml}".into()),
            service_node: Some("sidecar~10.0.0.1~pod.ns~ns.svc.cluster.local".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            loaded.bootstrap.node.unwrap().id,
            "sidecar~10.0.0.1~pod.ns~ns.svc.cluster.local"
        );
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = load(&Options {
            config_path: Some("/nonexistent/envoy.yaml".into()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("reading /nonexistent/envoy.yaml: "),
            "{err}"
        );
    }

    #[test]
    fn nothing_to_load_is_an_error() {
        assert!(matches!(
            load(&Options::default()),
            Err(LoadError::NoBootstrap)
        ));
    }

    #[test]
    fn format_follows_extension_then_content() {
        assert_eq!(Format::of(Path::new("a.json"), b"x: 1"), Format::Json);
        assert_eq!(Format::of(Path::new("a.yml"), b"{}"), Format::Yaml);
        assert_eq!(
            Format::of(Path::new("envoy-rev0"), b"  {\"a\":1}"),
            Format::Json
        );
        assert_eq!(
            Format::of(Path::new("envoy-rev0"), b"admin: {}"),
            Format::Yaml
        );
    }
}
