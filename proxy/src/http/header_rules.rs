//! Header rules: the `*_headers_to_add` / `*_headers_to_remove` lists of a route, a
//! virtual host and a route configuration, compiled once and applied to each request or
//! response (removals first, then additions, as Envoy's `HeaderParser`).

use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

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
