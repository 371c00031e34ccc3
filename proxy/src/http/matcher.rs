//! Envoy's request matchers as compiled for routes: `StringMatcher` (exact, prefix,
//! suffix, contains, safe_regex; `ignore_case`), `HeaderMatcher` and
//! `QueryParameterMatcher`, each compiled from Envoy's config and evaluated against a
//! [`RequestView`].

use envoy_types::pb::envoy::config::route::v3::{
    HeaderMatcher as EnvoyHeaderMatcher, QueryParameterMatcher as EnvoyQueryMatcher,
    header_matcher::HeaderMatchSpecifier, query_parameter_matcher::QueryParameterMatchSpecifier,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    RegexMatcher, StringMatcher as EnvoyStringMatcher, string_matcher::MatchPattern,
};
use hyper::HeaderMap;
use regex::Regex;

use crate::config::Diagnostics;

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
        self.matches_value(request.header(&self.name))
    }

    /// The same on the header's (joined) value, `None` when absent.
    pub fn matches_value(&self, value: Option<String>) -> bool {
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

/// A `RegexMatcher`, anchored (Envoy's regexes match whole values).
pub fn regex(re: &RegexMatcher, path: &str, problems: &mut Diagnostics) -> Option<regex::Regex> {
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
                format!("{path}.regex"),
                format!("{:?} is not a valid regex: {why}", re.regex),
            );
            None
        }
    }
}

/// A `StringMatcher`.
pub fn string_matcher(
    m: &EnvoyStringMatcher,
    path: &str,
    problems: &mut Diagnostics,
) -> Option<StringMatcher> {
    let pattern = match &m.match_pattern {
        Some(MatchPattern::Exact(s)) => StringPattern::Exact(s.clone()),
        Some(MatchPattern::Prefix(s)) => StringPattern::Prefix(s.clone()),
        Some(MatchPattern::Suffix(s)) => StringPattern::Suffix(s.clone()),
        Some(MatchPattern::Contains(s)) => StringPattern::Contains(s.clone()),
        Some(MatchPattern::SafeRegex(re)) => {
            StringPattern::Regex(regex(re, &format!("{path}.safe_regex"), problems)?)
        }
        Some(MatchPattern::Custom(_)) => {
            problems.error(
                format!("{path}.custom"),
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
    path: &str,
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
            regex(re, &format!("{path}.safe_regex_match"), problems)
                .and_then(|re| exact(StringPattern::Regex(re)))
        }
        Some(HeaderMatchSpecifier::StringMatch(m)) => {
            string_matcher(m, &format!("{path}.string_match"), problems).map(HeaderMatch::String)
        }
        Some(HeaderMatchSpecifier::RangeMatch(_)) => {
            problems.error(
                format!("{path}.range_match"),
                "range matching is not implemented yet",
            );
            None
        }
    };
    if h.name.is_empty() {
        problems.error(format!("{path}.name"), "is required");
        return None;
    }
    Some(HeaderMatcher {
        name: h.name.to_ascii_lowercase(),
        matcher: matcher?,
        invert: h.invert_match,
        treat_missing_as_empty: h.treat_missing_header_as_empty,
    })
}

/// A `QueryParameterMatcher`: `string_match`, or `present_match: true`.
pub fn query_matcher(
    q: &EnvoyQueryMatcher,
    path: &str,
    problems: &mut Diagnostics,
) -> Option<QueryParameterMatcher> {
    let matcher = match &q.query_parameter_match_specifier {
        Some(QueryParameterMatchSpecifier::StringMatch(m)) => Some(string_matcher(
            m,
            &format!("{path}.string_match"),
            problems,
        )?),
        Some(QueryParameterMatchSpecifier::PresentMatch(true)) => None,
        _ => {
            problems.error(
                path,
                "a query parameter matcher needs string_match or present_match: true",
            );
            return None;
        }
    };
    Some(QueryParameterMatcher {
        name: q.name.clone(),
        matcher,
    })
}
