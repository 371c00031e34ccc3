//! Diagnostics: what loading, validating or compiling a config found wrong, each at a
//! JSON path into the config as the loader writes them
//! (`static_resources.listeners[0].filter_chains[1].filters[0]`). Every stage collects
//! them and goes on after an error, so one run reports all of them.
//!
//! ERROR means shunt cannot serve the config as written; WARNING means it would serve it
//! but not do everything Envoy would.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    Warning,
    Error,
}

impl Severity {
    pub fn label(self) -> &'static str {
        match self {
            Severity::Warning => "WARNING",
            Severity::Error => "ERROR",
        }
    }
}

/// One thing a stage has to say, at a JSON path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub severity: Severity,
    pub path: String,
    pub message: String,
}

impl Diagnostic {
    pub fn error(path: impl Into<String>, message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Error,
            path: path.into(),
            message: message.into(),
        }
    }

    pub fn warning(path: impl Into<String>, message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Warning,
            path: path.into(),
            message: message.into(),
        }
    }
}

/// `path: message` (the message alone at the root); the severity is the reader's label.
impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// A step failed and said why in its [`Diagnostics`]: nothing more to report. What
/// compiling one part of a config (a message, a field) gives is `Result<T, Reported>`;
/// a compile goes on after a failed part, so that one run reports every error, and
/// fails if any part did (see [`Parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported;

/// Whether every part of a message compiled: each part's result is noted as it comes
/// (the compile goes on after a failed one), and the message fails at the end if any
/// part did.
#[derive(Debug, Clone, Copy, Default)]
#[must_use = "a failed part must fail the message: end with `finish` or `and`"]
pub struct Parts {
    failed: bool,
}

impl Parts {
    /// The part's value, noting its failure.
    pub fn note<T>(&mut self, part: Result<T, Reported>) -> Option<T> {
        self.failed |= part.is_err();
        part.ok()
    }

    /// The part's value, or `fallback` to go on with when it failed (what later parts
    /// then see, so that they report what they would have reported before).
    pub fn or<T>(&mut self, part: Result<T, Reported>, fallback: T) -> T {
        self.note(part).unwrap_or(fallback)
    }

    /// The part's value, or its type's default to go on with when it failed.
    pub fn or_default<T: Default>(&mut self, part: Result<T, Reported>) -> T {
        self.note(part).unwrap_or_default()
    }

    /// Notes a failure the message found itself (its error already reported).
    pub fn fail(&mut self, reported: Reported) {
        let Reported = reported;
        self.failed = true;
    }

    /// Whether no part failed so far.
    pub fn ok(&self) -> bool {
        !self.failed
    }

    /// `Ok(())` if no part failed.
    pub fn finish(self) -> Result<(), Reported> {
        if self.failed { Err(Reported) } else { Ok(()) }
    }

    /// `value` if no part failed.
    pub fn and<T>(self, value: T) -> Result<T, Reported> {
        self.finish().map(|()| value)
    }
}

/// Compiles each of `items` with `compile`, going on after a failed one: all of them,
/// or [`Reported`] if any failed (each said why).
pub fn compile_each<I, T>(
    items: impl IntoIterator<Item = I>,
    mut compile: impl FnMut(I) -> Result<T, Reported>,
) -> Result<Vec<T>, Reported> {
    let mut parts = Parts::default();
    let compiled: Vec<T> = items
        .into_iter()
        .filter_map(|item| parts.note(compile(item)))
        .collect();
    parts.and(compiled)
}

/// A JSON path into a config as diagnostics name it
/// (`static_resources.clusters[2].load_assignment`), built a step at a time as a compile
/// goes down into a message: each step is a new path, the parent's stays as it was.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct JsonPath(String);

impl JsonPath {
    /// A path from its root: `static_resources`, or a resource (`Cluster "name"`).
    pub fn new(root: impl Into<String>) -> Self {
        JsonPath(root.into())
    }

    /// A resource's path: `static_resources.<list>[index]` for the bootstrap's, else
    /// (one from xDS) `<kind> "name"`, as in `Cluster "reviews"`.
    pub fn resource(list: &str, kind: &str, index: Option<usize>, name: &str) -> Self {
        match index {
            Some(i) => JsonPath::new("static_resources").field(list).index(i),
            None => JsonPath(format!("{kind} {name:?}")),
        }
    }

    /// `path.name`: a field of the message at this path.
    pub fn field(&self, name: &str) -> JsonPath {
        JsonPath(format!("{}.{name}", self.0))
    }

    /// `path[index]`: an element of the list at this path.
    pub fn index(&self, index: usize) -> JsonPath {
        JsonPath(format!("{}[{index}]", self.0))
    }

    /// `path["key"]`: an entry of the map at this path, its key quoted.
    pub fn key(&self, key: &str) -> JsonPath {
        JsonPath(format!("{}[{key:?}]", self.0))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A path reads as its text: code that takes a `&str` path takes a `&JsonPath`.
impl std::ops::Deref for JsonPath {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JsonPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<JsonPath> for String {
    fn from(path: JsonPath) -> String {
        path.0
    }
}

impl From<&JsonPath> for String {
    fn from(path: &JsonPath) -> String {
        path.0.clone()
    }
}

impl PartialEq<str> for JsonPath {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for JsonPath {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// The config cannot be served as written.
#[derive(Debug, thiserror::Error)]
pub struct CompileError {
    pub errors: Vec<Diagnostic>,
    /// What compiling also warned about (not part of the message).
    pub warnings: Vec<Diagnostic>,
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.errors.len();
        write!(
            f,
            "{n} error{} in the configuration",
            if n == 1 { "" } else { "s" }
        )?;
        for error in &self.errors {
            write!(f, "\n  {error}")?;
        }
        Ok(())
    }
}

/// What a compile collects: errors and warnings apart, each in the order found.
#[derive(Debug, Default)]
pub struct Diagnostics {
    pub errors: Vec<Diagnostic>,
    pub warnings: Vec<Diagnostic>,
}

impl Diagnostics {
    /// Reports an error; the [`Reported`] returned is what the failed part returns.
    pub fn error(&mut self, path: impl Into<String>, message: impl Into<String>) -> Reported {
        self.errors.push(Diagnostic::error(path, message));
        Reported
    }

    pub fn warning(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Diagnostic::warning(path, message));
    }

    pub fn finish(&mut self) -> Result<(), CompileError> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(CompileError {
                errors: std::mem::take(&mut self.errors),
                warnings: std::mem::take(&mut self.warnings),
            })
        }
    }
}
