//! Envoy's request matchers, shared by routes and filters (RBAC, CORS, fault,
//! ext_authz): `StringMatcher` (exact, prefix, suffix, contains, safe_regex;
//! `ignore_case`) and `HeaderMatcher`, each compiled from Envoy's config and evaluated
//! against a [`RequestView`]. The routes' own `QueryParameterMatcher` is in
//! `http::route`.

use std::borrow::Cow;

use envoy_types::pb::envoy::config::route::v3::{
    HeaderMatcher as EnvoyHeaderMatcher, header_matcher::HeaderMatchSpecifier,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    RegexMatcher, StringMatcher as EnvoyStringMatcher, string_matcher::MatchPattern,
};
use hyper::HeaderMap;
use regex::Regex;

use shunt_config::{Diagnostics, JsonPath};

/// What route matching reads from a request. Pseudo-headers (`:method`, `:authority`,
/// `:path`, `:scheme`) are fields because HTTP/1.1 requests do not carry them as headers.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    pub method: &'a str,
    pub authority: &'a str,
    /// Path and query, as received.
    pub path: &'a str,
    pub scheme: &'a str,
    pub headers: &'a HeaderMap,
}

impl RequestView<'_> {
    /// All values of header `name` joined with `,` (Envoy matches multi-valued headers
    /// that way); `None` when absent.
    pub fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        match name {
            ":method" => return Some(Cow::Borrowed(self.method)),
            ":authority" | "host" => return Some(Cow::Borrowed(self.authority)),
            ":path" => return Some(Cow::Borrowed(self.path)),
            ":scheme" => return Some(Cow::Borrowed(self.scheme)),
            _ => {}
        }
        let mut values = self.headers.get_all(name).iter();
        let first = String::from_utf8_lossy(values.next()?.as_bytes());
        // Most headers have one value: matched where it lies, not copied.
        let Some(second) = values.next() else {
            return Some(first);
        };
        let mut joined = first.into_owned();
        for value in std::iter::once(second).chain(values) {
            joined.push(',');
            joined.push_str(&String::from_utf8_lossy(value.as_bytes()));
        }
        Some(Cow::Owned(joined))
    }

    /// The path without its query string (what path matchers read).
    pub fn path_only(&self) -> &str {
        self.path.split(['?', '#']).next().unwrap_or("")
    }

    /// The query string's parameters, undecoded, in order.
    pub fn query_parameters(&self) -> impl Iterator<Item = (&str, &str)> {
        let query = self.path.split_once('?').map_or("", |(_, q)| q);
        let query = query.split('#').next().unwrap_or("");
        query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| p.split_once('=').unwrap_or((p, "")))
    }
}

#[derive(Debug)]
pub enum StringPattern {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Contains(String),
    /// Anchored at both ends: Envoy's regexes match the whole value.
    Regex(Regex),
}

#[derive(Debug)]
pub struct StringMatcher {
    pub pattern: StringPattern,
    /// Compares ASCII letters without case; ignored by regexes, as in Envoy.
    pub ignore_case: bool,
}

impl StringMatcher {
    pub fn matches(&self, value: &str) -> bool {
        // Compared in place: rules run per request, often many (RBAC policies).
        let (bytes, fold) = (value.as_bytes(), self.ignore_case);
        let same = |a: &[u8], b: &[u8]| {
            if fold {
                a.eq_ignore_ascii_case(b)
            } else {
                a == b
            }
        };
        match &self.pattern {
            StringPattern::Exact(s) => same(bytes, s.as_bytes()),
            StringPattern::Prefix(s) => bytes
                .get(..s.len())
                .is_some_and(|start| same(start, s.as_bytes())),
            StringPattern::Suffix(s) => bytes
                .len()
                .checked_sub(s.len())
                .is_some_and(|at| same(&bytes[at..], s.as_bytes())),
            StringPattern::Contains(s) => {
                s.is_empty() || bytes.windows(s.len()).any(|w| same(w, s.as_bytes()))
            }
            StringPattern::Regex(re) => re.is_match(value),
        }
    }
}

/// A whole-value regex, as Envoy's `safe_regex` (RE2 full match).
pub fn full_match_regex(regex: &str) -> Result<Regex, regex::Error> {
    Regex::new(&format!("^(?:{regex})$"))
}

#[derive(Debug)]
pub enum HeaderMatch {
    /// `present_match`: true matches a present header, false an absent one.
    Present(bool),
    String(StringMatcher),
}

#[derive(Debug)]
pub struct HeaderMatcher {
    /// Lowercase.
    pub name: String,
    pub matcher: HeaderMatch,
    pub invert: bool,
    pub treat_missing_as_empty: bool,
}

impl HeaderMatcher {
    /// Envoy's `HeaderUtility::matchHeaders`, missing-header rules included.
    pub fn matches(&self, request: &RequestView<'_>) -> bool {
        self.matches_value(request.header(&self.name))
    }

    /// The same on the header's (joined) value, `None` when absent.
    pub fn matches_value(&self, value: Option<Cow<'_, str>>) -> bool {
        let value = match value {
            Some(value) => value,
            None if self.treat_missing_as_empty => Cow::Borrowed(""),
            None => {
                // An absent header matches only `present_match: false` (or, inverted,
                // only `present_match: true`).
                return match self.matcher {
                    HeaderMatch::Present(present) => present == self.invert,
                    HeaderMatch::String(_) => false,
                };
            }
        };
        let matched = match &self.matcher {
            HeaderMatch::Present(present) => *present,
            HeaderMatch::String(matcher) => matcher.matches(&value),
        };
        matched != self.invert
    }
}

/// A `RegexMatcher`, anchored (Envoy's regexes match whole values).
pub fn regex(
    re: &RegexMatcher,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<regex::Regex> {
    match full_match_regex(&re.regex) {
        Ok(re) => Some(re),
        Err(err) => {
            // The regex crate's message draws the pattern over lines; its last says why.
            let why = err.to_string();
            let why = why
                .lines()
                .last()
                .unwrap_or_default()
                .trim_start_matches("error: ")
                .to_owned();
            problems.error(
                path.field("regex"),
                format!("{:?} is not a valid regex: {why}", re.regex),
            );
            None
        }
    }
}

/// A `StringMatcher`.
pub fn string_matcher(
    m: &EnvoyStringMatcher,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<StringMatcher> {
    let pattern = match &m.match_pattern {
        Some(MatchPattern::Exact(s)) => StringPattern::Exact(s.clone()),
        Some(MatchPattern::Prefix(s)) => StringPattern::Prefix(s.clone()),
        Some(MatchPattern::Suffix(s)) => StringPattern::Suffix(s.clone()),
        Some(MatchPattern::Contains(s)) => StringPattern::Contains(s.clone()),
        Some(MatchPattern::SafeRegex(re)) => {
            StringPattern::Regex(regex(re, &path.field("safe_regex"), problems)?)
        }
        Some(MatchPattern::Custom(_)) => {
            problems.error(
                path.field("custom"),
                "custom string matchers are not implemented yet",
            );
            return None;
        }
        None => {
            problems.error(path, "a string matcher needs a pattern");
            return None;
        }
    };
    Some(StringMatcher {
        pattern,
        ignore_case: m.ignore_case,
    })
}

/// A `HeaderMatcher` (the deprecated `*_match` forms are still accepted by Envoy, and
/// by us).
#[allow(deprecated)]
pub fn header_matcher(
    h: &EnvoyHeaderMatcher,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<HeaderMatcher> {
    let exact = |p: StringPattern| {
        Some(HeaderMatch::String(StringMatcher {
            pattern: p,
            ignore_case: false,
        }))
    };
    let matcher = match &h.header_match_specifier {
        // No specifier: the header must be present.
        None => Some(HeaderMatch::Present(true)),
        Some(HeaderMatchSpecifier::PresentMatch(present)) => Some(HeaderMatch::Present(*present)),
        Some(HeaderMatchSpecifier::ExactMatch(s)) => exact(StringPattern::Exact(s.clone())),
        Some(HeaderMatchSpecifier::PrefixMatch(s)) => exact(StringPattern::Prefix(s.clone())),
        Some(HeaderMatchSpecifier::SuffixMatch(s)) => exact(StringPattern::Suffix(s.clone())),
        Some(HeaderMatchSpecifier::ContainsMatch(s)) => exact(StringPattern::Contains(s.clone())),
        Some(HeaderMatchSpecifier::SafeRegexMatch(re)) => {
            regex(re, &path.field("safe_regex_match"), problems)
                .and_then(|re| exact(StringPattern::Regex(re)))
        }
        Some(HeaderMatchSpecifier::StringMatch(m)) => {
            string_matcher(m, &path.field("string_match"), problems).map(HeaderMatch::String)
        }
        Some(HeaderMatchSpecifier::RangeMatch(_)) => {
            problems.error(
                path.field("range_match"),
                "range matching is not implemented yet",
            );
            None
        }
    };
    if h.name.is_empty() {
        problems.error(path.field("name"), "is required");
        return None;
    }
    Some(HeaderMatcher {
        name: h.name.to_ascii_lowercase(),
        matcher: matcher?,
        invert: h.invert_match,
        treat_missing_as_empty: h.treat_missing_header_as_empty,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(pattern: StringPattern, ignore_case: bool) -> StringMatcher {
        StringMatcher {
            pattern,
            ignore_case,
        }
    }

    #[test]
    fn string_matchers_compare_in_place_with_and_without_case() {
        let s = |v: &str| v.to_owned();
        let cases = [
            (StringPattern::Exact(s("GET")), false, "GET", true),
            (StringPattern::Exact(s("GET")), false, "get", false),
            (StringPattern::Exact(s("GET")), true, "get", true),
            (StringPattern::Exact(s("GET")), true, "GETS", false),
            (StringPattern::Prefix(s("/api/")), false, "/api/x", true),
            (StringPattern::Prefix(s("/API/")), true, "/api/x", true),
            (StringPattern::Prefix(s("/api/")), false, "/ap", false),
            (
                StringPattern::Prefix(s("/tenant-1/")),
                false,
                "/api/x",
                false,
            ),
            (StringPattern::Prefix(s("")), false, "", true),
            (StringPattern::Suffix(s(".local")), false, "svc.local", true),
            (StringPattern::Suffix(s(".LOCAL")), true, "svc.local", true),
            (StringPattern::Suffix(s(".local")), false, "local", false),
            (StringPattern::Contains(s("ten")), false, "x-tenant-1", true),
            (StringPattern::Contains(s("TEN")), true, "x-tenant-1", true),
            (
                StringPattern::Contains(s("TEN")),
                false,
                "x-tenant-1",
                false,
            ),
            (StringPattern::Contains(s("")), false, "", true),
            (StringPattern::Contains(s("long")), false, "lo", false),
            // Multi-byte text: compared as bytes, case folded only in ASCII.
            (StringPattern::Prefix(s("é")), false, "éa", true),
            (StringPattern::Exact(s("É")), true, "é", false),
        ];
        for (pattern, ignore_case, value, want) in cases {
            let m = matcher(pattern, ignore_case);
            assert_eq!(m.matches(value), want, "{m:?} on {value:?}");
        }
        let regex = matcher(StringPattern::Regex(full_match_regex("a+").unwrap()), true);
        assert!(regex.matches("aaa") && !regex.matches("aab"));
    }

    #[test]
    fn a_header_with_several_values_is_matched_joined_and_one_value_where_it_lies() {
        let mut headers = HeaderMap::new();
        headers.append("x-tenant", "a".parse().unwrap());
        headers.append("x-tenant", "b".parse().unwrap());
        headers.insert("x-one", "only".parse().unwrap());
        let view = RequestView {
            method: "GET",
            authority: "svc",
            path: "/p?q",
            scheme: "http",
            headers: &headers,
        };
        assert_eq!(view.header("x-tenant").as_deref(), Some("a,b"));
        assert!(matches!(view.header("x-one"), Some(Cow::Borrowed("only"))));
        assert_eq!(view.header(":path").as_deref(), Some("/p?q"));
        assert_eq!(view.header("x-none"), None);
    }
}
