//! Envoy's request matchers as compiled for routes: `StringMatcher` (exact, prefix,
//! suffix, contains, safe_regex; `ignore_case`), `HeaderMatcher` and
//! `QueryParameterMatcher`, each evaluated against a [`RequestView`].

use hyper::HeaderMap;
use regex::Regex;

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
    pub fn header(&self, name: &str) -> Option<String> {
        match name {
            ":method" => return Some(self.method.to_owned()),
            ":authority" | "host" => return Some(self.authority.to_owned()),
            ":path" => return Some(self.path.to_owned()),
            ":scheme" => return Some(self.scheme.to_owned()),
            _ => {}
        }
        let mut values = self.headers.get_all(name).iter();
        let first = values.next()?;
        let mut joined = String::from_utf8_lossy(first.as_bytes()).into_owned();
        for value in values {
            joined.push(',');
            joined.push_str(&String::from_utf8_lossy(value.as_bytes()));
        }
        Some(joined)
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
    /// Lowercases both sides; ignored by regexes, as in Envoy.
    pub ignore_case: bool,
}

impl StringMatcher {
    pub fn matches(&self, value: &str) -> bool {
        let fold = |s: &str| {
            if self.ignore_case {
                s.to_ascii_lowercase()
            } else {
                s.to_owned()
            }
        };
        match &self.pattern {
            StringPattern::Exact(s) => fold(value) == fold(s),
            StringPattern::Prefix(s) => fold(value).starts_with(&fold(s)),
            StringPattern::Suffix(s) => fold(value).ends_with(&fold(s)),
            StringPattern::Contains(s) => fold(value).contains(&fold(s)),
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
        let value = request.header(&self.name);
        let value = match value {
            Some(value) => value,
            None if self.treat_missing_as_empty => String::new(),
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

#[derive(Debug)]
pub struct QueryParameterMatcher {
    pub name: String,
    /// `None`: `present_match`, any value.
    pub matcher: Option<StringMatcher>,
}

impl QueryParameterMatcher {
    pub fn matches(&self, request: &RequestView<'_>) -> bool {
        request
            .query_parameters()
            .find(|(name, _)| *name == self.name)
            .is_some_and(|(_, value)| self.matcher.as_ref().is_none_or(|m| m.matches(value)))
    }
}
