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

/// A step failed and said why in its [`Diagnostics`]: nothing more to report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported;

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
    pub fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Diagnostic::error(path, message));
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
