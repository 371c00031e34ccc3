//! What compiling found wrong, each at a JSON path into the bootstrap written as the
//! config loader writes them (`static_resources.listeners[0].filter_chains[1].filters[0]`).
//! Compilation goes on after an error, so one run reports all of them.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The bootstrap cannot be served as written.
#[derive(Debug, thiserror::Error)]
pub struct CompileError {
    pub errors: Vec<Problem>,
    /// What compiling also warned about (not part of the message).
    pub warnings: Vec<Problem>,
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

#[derive(Debug, Default)]
pub struct Problems {
    pub errors: Vec<Problem>,
    pub warnings: Vec<Problem>,
}

impl Problems {
    pub fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    pub fn warning(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Problem {
            path: path.into(),
            message: message.into(),
        });
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
