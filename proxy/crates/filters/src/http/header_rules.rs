//! Header rules: the `*_headers_to_add` / `*_headers_to_remove` lists of a route, a
//! virtual host and a route configuration, compiled once and applied to each request or
//! response (removals first, then additions, as Envoy's `HeaderParser`).

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValueOption, header_value_option::HeaderAppendAction,
};
use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

use shunt_config::{Diagnostics, JsonPath};

/// Envoy's `HeaderValueOption.append_action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendAction {
    /// Another value beside any existing ones (the default).
    AppendIfExistsOrAdd,
    AddIfAbsent,
    OverwriteIfExistsOrAdd,
    /// Replace only a header that is there.
    OverwriteIfExists,
}

#[derive(Debug, Clone)]
pub struct HeaderAdd {
    pub name: HeaderName,
    pub value: HeaderValue,
    pub action: AppendAction,
}

#[derive(Debug, Clone, Default)]
pub struct HeaderRules {
    pub remove: Vec<HeaderName>,
    pub add: Vec<HeaderAdd>,
}

impl HeaderRules {
    pub fn apply(&self, headers: &mut HeaderMap) {
        for name in &self.remove {
            headers.remove(name);
        }
        for add in &self.add {
            match add.action {
                AppendAction::AppendIfExistsOrAdd => {
                    headers.append(add.name.clone(), add.value.clone());
                }
                AppendAction::AddIfAbsent => {
                    if !headers.contains_key(&add.name) {
                        headers.insert(add.name.clone(), add.value.clone());
                    }
                }
                AppendAction::OverwriteIfExistsOrAdd => {
                    headers.insert(add.name.clone(), add.value.clone());
                }
                AppendAction::OverwriteIfExists => {
                    if headers.contains_key(&add.name) {
                        headers.insert(add.name.clone(), add.value.clone());
                    }
                }
            }
        }
    }
}

/// Compiles a level's `<kind>_headers_to_add` and `<kind>_headers_to_remove`.
#[allow(deprecated, reason = "Envoy still honours `append`")]
pub fn compile(
    add: &[HeaderValueOption],
    remove: &[String],
    path: &JsonPath,
    kind: &str,
    problems: &mut Diagnostics,
) -> HeaderRules {
    let mut rules = HeaderRules::default();
    for (i, name) in remove.iter().enumerate() {
        let r_path = path.field(&format!("{kind}_headers_to_remove")).index(i);
        let lower = name.to_ascii_lowercase();
        if lower.starts_with(':') || lower == "host" {
            problems.error(r_path, format!("{name:?} cannot be removed"));
            continue;
        }
        match HeaderName::from_bytes(lower.as_bytes()) {
            Ok(name) => rules.remove.push(name),
            Err(_) => {
                problems.error(r_path, format!("{name:?} is not a header name"));
            }
        }
    }
    for (i, option) in add.iter().enumerate() {
        let a_path = path.field(&format!("{kind}_headers_to_add")).index(i);
        let Some(header) = &option.header else {
            problems.error(a_path.field("header"), "is required");
            continue;
        };
        let lower = header.key.to_ascii_lowercase();
        if lower.starts_with(':') || lower == "host" {
            problems.error(
                a_path.field("header").field("key"),
                format!("{:?} cannot be set by a header rule", header.key),
            );
            continue;
        }
        let Ok(name) = HeaderName::from_bytes(lower.as_bytes()) else {
            problems.error(
                a_path.field("header").field("key"),
                format!("{:?} is not a header name", header.key),
            );
            continue;
        };
        let raw = if header.raw_value.is_empty() {
            header.value.as_bytes()
        } else {
            header.raw_value.as_slice()
        };
        if raw.contains(&b'%') {
            problems.warning(
                a_path.field("header").field("value"),
                "command operators (%...%) in header values are not implemented; the value is sent as written",
            );
        }
        let Ok(value) = HeaderValue::from_bytes(raw) else {
            problems.error(
                a_path.field("header").field("value"),
                "is not a valid header value",
            );
            continue;
        };
        // Envoy leaves out a header whose value is empty unless asked to keep it.
        if value.is_empty() && !option.keep_empty_value {
            continue;
        }
        let action = match option.append {
            Some(append) if append.value => AppendAction::AppendIfExistsOrAdd,
            Some(_) => AppendAction::OverwriteIfExistsOrAdd,
            None => match HeaderAppendAction::try_from(option.append_action) {
                Ok(HeaderAppendAction::AddIfAbsent) => AppendAction::AddIfAbsent,
                Ok(HeaderAppendAction::OverwriteIfExistsOrAdd) => {
                    AppendAction::OverwriteIfExistsOrAdd
                }
                Ok(HeaderAppendAction::OverwriteIfExists) => AppendAction::OverwriteIfExists,
                _ => AppendAction::AppendIfExistsOrAdd,
            },
        };
        rules.add.push(HeaderAdd {
            name,
            value,
            action,
        });
    }
    rules
}
