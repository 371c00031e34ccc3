//! Envoy's `DataSource`: where a certificate, key or CA bundle comes from (a file, inline
//! bytes or string, an environment variable). One reader for the data plane's secrets and
//! the xDS client's own TLS, so both name a bad source the same way.

use envoy_types::pb::envoy::config::core::v3::DataSource;
use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;

/// What is wrong, at which JSON path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl std::error::Error for Error {}

/// The bytes of `source` (at JSON path `path`); a file's error names the file and why
/// it could not be read.
pub fn read(source: &DataSource, path: &str) -> Result<Vec<u8>, Error> {
    let error = |field: &str, message: String| Error {
        path: format!("{path}{field}"),
        message,
    };
    match &source.specifier {
        Some(Specifier::Filename(file)) => {
            std::fs::read(file).map_err(|e| error(".filename", format!("reading {file}: {e}")))
        }
        Some(Specifier::InlineBytes(bytes)) => Ok(bytes.clone()),
        Some(Specifier::InlineString(text)) => Ok(text.clone().into_bytes()),
        Some(Specifier::EnvironmentVariable(var)) => std::env::var(var)
            .map(String::into_bytes)
            .map_err(|_| error(".environment_variable", format!("{var} is not set"))),
        None => Err(error("", "empty data source".into())),
    }
}

/// `source` read and parsed by `parse`, whose error is reported at `path`.
pub fn read_with<T>(
    source: &DataSource,
    path: &str,
    parse: impl FnOnce(&[u8]) -> Result<T, String>,
) -> Result<T, Error> {
    let bytes = read(source, path)?;
    parse(&bytes).map_err(|message| Error {
        path: path.to_owned(),
        message,
    })
}
