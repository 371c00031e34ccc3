//! The resources the server serves: per type URL, a version and named resources, each
//! with its own version (what Delta clients track).

use super::Any;
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone)]
pub(crate) struct Resource {
    pub any: Any,
    /// The type version of the `set` that last changed this resource's bytes.
    pub version: String,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct TypeState {
    pub version: String,
    /// Sorted, so responses list resources in a stable order.
    pub resources: BTreeMap<String, Resource>,
}

#[derive(Debug, Default)]
pub(crate) struct Store {
    types: HashMap<String, TypeState>,
}

impl Store {
    pub fn get(&self, type_url: &str) -> Option<&TypeState> {
        self.types.get(type_url)
    }

    /// Replace a type's resources. A resource keeps its old version when its bytes are
    /// unchanged, so Delta clients are not sent what they already have. A name given
    /// twice keeps the last.
    pub fn set(&mut self, type_url: &str, version: &str, resources: Vec<(String, Any)>) {
        let old = self.types.remove(type_url).unwrap_or_default();
        let resources = resources
            .into_iter()
            .map(|(name, any)| {
                let version = match old.resources.get(&name) {
                    Some(prev) if prev.any == any => prev.version.clone(),
                    _ => version.to_owned(),
                };
                (name, Resource { any, version })
            })
            .collect();
        self.types.insert(
            type_url.to_owned(),
            TypeState {
                version: version.to_owned(),
                resources,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(value: &[u8]) -> Any {
        Any {
            type_url: "type.googleapis.com/t".into(),
            value: value.to_vec(),
        }
    }

    #[test]
    fn per_resource_version_changes_only_with_bytes() {
        let mut store = Store::default();
        store.set(
            "t",
            "1",
            vec![("a".into(), any(b"a")), ("b".into(), any(b"b"))],
        );
        store.set(
            "t",
            "2",
            vec![("a".into(), any(b"a")), ("b".into(), any(b"B"))],
        );
        let ts = store.get("t").unwrap();
        assert_eq!(ts.version, "2");
        assert_eq!(ts.resources["a"].version, "1");
        assert_eq!(ts.resources["b"].version, "2");
        // Removed and re-added with the same bytes: new version (the client dropped it).
        store.set("t", "3", vec![("b".into(), any(b"B"))]);
        store.set(
            "t",
            "4",
            vec![("a".into(), any(b"a")), ("b".into(), any(b"B"))],
        );
        let ts = store.get("t").unwrap();
        assert_eq!(ts.resources["a"].version, "4");
        assert_eq!(ts.resources["b"].version, "2");
    }
}
