//! Subject alternative names: reading them from a peer's certificate and matching them
//! against a validation context's `match_typed_subject_alt_names` (or the deprecated
//! `match_subject_alt_names`), as Envoy does. This is how a mesh checks identity: Istio
//! asks for the peer's SPIFFE URI (`spiffe://cluster.local/ns/x/sa/y`).
//!
//! The SANs are read with a few lines of DER walking rather than an X.509 crate: only the
//! `subjectAltName` extension is needed, and the chain itself is verified by webpki first.

use std::net::IpAddr;

use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::SubjectAltNameMatcher;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::subject_alt_name_matcher::SanType as EnvoySanType;
use envoy_types::pb::envoy::r#type::matcher::v3::StringMatcher;
use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;

use shunt_config::{Diagnostics, JsonPath};

/// One SAN of a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum San {
    Dns(String),
    Uri(String),
    Ip(IpAddr),
    Email(String),
}

impl San {
    fn kind(&self) -> SanType {
        match self {
            San::Dns(_) => SanType::Dns,
            San::Uri(_) => SanType::Uri,
            San::Ip(_) => SanType::IpAddress,
            San::Email(_) => SanType::Email,
        }
    }

    /// The SAN as Envoy compares it: IP addresses in their usual text form.
    fn text(&self) -> String {
        match self {
            San::Dns(s) | San::Uri(s) | San::Email(s) => s.clone(),
            San::Ip(ip) => ip.to_string(),
        }
    }
}

impl std::fmt::Display for San {
    /// As openssl prints SANs: `DNS:a.example`, `URI:spiffe://...`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            San::Dns(_) => "DNS",
            San::Uri(_) => "URI",
            San::Ip(_) => "IP",
            San::Email(_) => "email",
        };
        write!(f, "{kind}:{}", self.text())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SanType {
    Dns,
    Uri,
    IpAddress,
    Email,
}

/// A `StringMatcher`, compiled.
#[derive(Debug, Clone)]
pub enum StringMatch {
    Exact(String, bool),
    Prefix(String, bool),
    Suffix(String, bool),
    Contains(String, bool),
    Regex(regex::Regex),
}

impl StringMatch {
    /// `matcher` at `path`; unknown or broken patterns are errors, since a matcher that
    /// matches nothing (or everything) would change who may connect.
    pub fn compile(
        matcher: &StringMatcher,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Self> {
        let ic = matcher.ignore_case;
        let fold = |s: &str| if ic { s.to_lowercase() } else { s.to_owned() };
        Some(match &matcher.match_pattern {
            Some(MatchPattern::Exact(s)) => StringMatch::Exact(fold(s), ic),
            Some(MatchPattern::Prefix(s)) => StringMatch::Prefix(fold(s), ic),
            Some(MatchPattern::Suffix(s)) => StringMatch::Suffix(fold(s), ic),
            Some(MatchPattern::Contains(s)) => StringMatch::Contains(fold(s), ic),
            // Envoy's safe_regex must match the whole string.
            Some(MatchPattern::SafeRegex(regex)) => {
                match regex::Regex::new(&format!("^(?:{})$", regex.regex)) {
                    Ok(regex) => StringMatch::Regex(regex),
                    Err(err) => {
                        problems.error(path.field("safe_regex").field("regex"), err.to_string());
                        return None;
                    }
                }
            }
            Some(MatchPattern::Custom(_)) => {
                problems.error(
                    path.field("custom"),
                    "custom string matchers are not implemented",
                );
                return None;
            }
            None => {
                problems.error(path, "a string matcher needs a pattern");
                return None;
            }
        })
    }

    pub fn matches(&self, value: &str) -> bool {
        let folded = |ic: bool| {
            if ic {
                std::borrow::Cow::Owned(value.to_lowercase())
            } else {
                std::borrow::Cow::Borrowed(value)
            }
        };
        match self {
            StringMatch::Exact(s, ic) => folded(*ic) == s.as_str(),
            StringMatch::Prefix(s, ic) => folded(*ic).starts_with(s.as_str()),
            StringMatch::Suffix(s, ic) => folded(*ic).ends_with(s.as_str()),
            StringMatch::Contains(s, ic) => folded(*ic).contains(s.as_str()),
            StringMatch::Regex(regex) => regex.is_match(value),
        }
    }
}

/// One entry of `match_typed_subject_alt_names`; `san_type: None` is the deprecated
/// `match_subject_alt_names`, which looks at every SAN whatever its type.
#[derive(Debug, Clone)]
pub struct SanMatcher {
    pub san_type: Option<SanType>,
    pub matcher: StringMatch,
}

impl SanMatcher {
    pub fn compile_typed(
        m: &SubjectAltNameMatcher,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Self> {
        let san_type = match EnvoySanType::try_from(m.san_type) {
            Ok(EnvoySanType::Dns) => SanType::Dns,
            Ok(EnvoySanType::Uri) => SanType::Uri,
            Ok(EnvoySanType::IpAddress) => SanType::IpAddress,
            Ok(EnvoySanType::Email) => SanType::Email,
            Ok(EnvoySanType::OtherName) => {
                problems.error(
                    path.field("san_type"),
                    "OTHER_NAME SANs are not implemented",
                );
                return None;
            }
            _ => {
                problems.error(
                    path.field("san_type"),
                    "needs a SAN type (DNS, URI, IP_ADDRESS or EMAIL)",
                );
                return None;
            }
        };
        let Some(matcher) = &m.matcher else {
            problems.error(path.field("matcher"), "needed");
            return None;
        };
        let matcher = StringMatch::compile(matcher, &path.field("matcher"), problems)?;
        Some(SanMatcher {
            san_type: Some(san_type),
            matcher,
        })
    }

    pub fn compile_untyped(
        m: &StringMatcher,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Self> {
        Some(SanMatcher {
            san_type: None,
            matcher: StringMatch::compile(m, path, problems)?,
        })
    }

    pub fn matches(&self, san: &San) -> bool {
        if self.san_type.is_some_and(|t| t != san.kind()) {
            return false;
        }
        let text = san.text();
        // A wildcard DNS SAN (`*.example.com`) covers one label, as Envoy's dnsNameMatch.
        if let (San::Dns(dns), StringMatch::Exact(want, _)) = (san, &self.matcher)
            && dns.starts_with("*.")
        {
            return dns_covers(dns, want);
        }
        self.matcher.matches(&text)
    }
}

/// Whether the DNS SAN `san` (maybe a wildcard `*.example.com`, which covers exactly
/// one label) covers the host name `name`, ignoring case.
pub fn dns_covers(san: &str, name: &str) -> bool {
    let (san, name) = (san.to_ascii_lowercase(), name.to_ascii_lowercase());
    match san.strip_prefix('*') {
        Some(suffix) if suffix.starts_with('.') => {
            name.len() > suffix.len()
                && name.ends_with(suffix)
                && !name[..name.len() - suffix.len()].contains('.')
        }
        _ => san == name,
    }
}

/// Whether a certificate with `sans` passes `matchers`: any one matching is enough, and
/// an empty list accepts every certificate.
pub fn accepts(matchers: &[SanMatcher], sans: &[San]) -> bool {
    matchers.is_empty() || matchers.iter().any(|m| sans.iter().any(|s| m.matches(s)))
}

/// The SANs of a DER certificate; an empty list when it has none or cannot be read
/// (the chain was verified before, so this only decides identity).
pub fn of_certificate(der: &[u8]) -> Vec<San> {
    subject_alt_names(der).unwrap_or_default()
}

/// `subjectAltName` (2.5.29.17).
const SAN_OID: &[u8] = &[0x55, 0x1d, 0x11];

fn subject_alt_names(der: &[u8]) -> Option<Vec<San>> {
    let (_, certificate, _) = element(der)?;
    let (_, tbs, _) = element(certificate)?;
    // tbsCertificate: [0] version, serial, signature, issuer, validity, subject, spki,
    // [1] issuerUID, [2] subjectUID, [3] extensions.
    let mut rest = tbs;
    while !rest.is_empty() {
        let (tag, body, next) = element(rest)?;
        rest = next;
        if tag != 0xa3 {
            continue;
        }
        let (_, mut extensions, _) = element(body)?;
        while !extensions.is_empty() {
            let (_, extension, next) = element(extensions)?;
            extensions = next;
            let (_, oid, mut fields) = element(extension)?;
            if oid != SAN_OID {
                continue;
            }
            // Skip `critical` if present; the value is an OCTET STRING.
            let (mut tag, mut value, after) = element(fields)?;
            if tag == 0x01 {
                fields = after;
                (tag, value, _) = element(fields)?;
            }
            if tag != 0x04 {
                return None;
            }
            return Some(general_names(value));
        }
        return Some(Vec::new());
    }
    Some(Vec::new())
}

fn general_names(value: &[u8]) -> Vec<San> {
    let mut sans = Vec::new();
    let Some((_, mut names, _)) = element(value) else {
        return sans;
    };
    while let Some((tag, body, next)) = element(names) {
        names = next;
        let text = || String::from_utf8_lossy(body).into_owned();
        match tag {
            0x81 => sans.push(San::Email(text())),
            0x82 => sans.push(San::Dns(text())),
            0x86 => sans.push(San::Uri(text())),
            0x87 => {
                if let Ok(v4) = <[u8; 4]>::try_from(body) {
                    sans.push(San::Ip(IpAddr::from(v4)));
                } else if let Ok(v6) = <[u8; 16]>::try_from(body) {
                    sans.push(San::Ip(IpAddr::from(v6)));
                }
            }
            _ => {}
        }
    }
    sans
}

/// One DER element of `input`: its tag, its contents and what follows it.
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}
