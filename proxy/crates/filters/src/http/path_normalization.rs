//! Envoy's HCM path normalization, before filters and routing see the path:
//! `path_with_escaped_slashes_action` (`%2F`/`%5C` kept, refused, unescaped and
//! forwarded, or unescaped and redirected), then `normalize_path` (RFC 3986 dot
//! segments, `\` as `/`, percent-encodings of unreserved characters decoded and the
//! rest upper-cased, as Envoy's Chromium-derived canonicalizer does), then
//! `merge_slashes`. The query is left as it is.

use std::borrow::Cow;

/// `path_with_escaped_slashes_action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    #[default]
    KeepUnchanged,
    RejectRequest,
    UnescapeAndRedirect,
    UnescapeAndForward,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathNormalization {
    pub normalize_path: bool,
    pub merge_slashes: bool,
    pub escaped_slashes: EscapedSlashes,
}

/// What normalization made of a request's path.
#[derive(Debug, PartialEq, Eq)]
pub enum Normalized<'a> {
    /// Go on with this path (and query).
    Path(Cow<'a, str>),
    /// 400 (`path_normalization_failed` / escaped slashes refused).
    Reject,
    /// 307 to this path (escaped slashes unescaped).
    Redirect(String),
}

impl PathNormalization {
    pub fn is_off(&self) -> bool {
        !self.normalize_path
            && !self.merge_slashes
            && self.escaped_slashes == EscapedSlashes::KeepUnchanged
    }

    /// Normalizes `path_and_query` (origin form: starts with `/`; anything else, like
    /// `*`, is left alone, as Envoy does).
    pub fn apply<'a>(&self, path_and_query: &'a str) -> Normalized<'a> {
        if self.is_off() || !path_and_query.starts_with('/') {
            return Normalized::Path(Cow::Borrowed(path_and_query));
        }
        let (path, query) = match path_and_query.find('?') {
            Some(at) => path_and_query.split_at(at),
            None => (path_and_query, ""),
        };
        let mut path = Cow::Borrowed(path);
        let mut redirect = false;
        if has_escaped_slash(&path) {
            match self.escaped_slashes {
                EscapedSlashes::KeepUnchanged => {}
                EscapedSlashes::RejectRequest => return Normalized::Reject,
                EscapedSlashes::UnescapeAndForward => path = Cow::Owned(unescape_slashes(&path)),
                EscapedSlashes::UnescapeAndRedirect => {
                    path = Cow::Owned(unescape_slashes(&path));
                    redirect = true;
                }
            }
        }
        if self.normalize_path {
            match canonical_path(&path) {
                Some(canonical) => {
                    if canonical != *path {
                        path = Cow::Owned(canonical);
                    }
                }
                None => return Normalized::Reject,
            }
        }
        if self.merge_slashes && path.contains("//") {
            path = Cow::Owned(merge_slashes(&path));
        }
        let joined = match path {
            Cow::Borrowed(_) => Cow::Borrowed(path_and_query),
            Cow::Owned(path) => Cow::Owned(path + query),
        };
        if redirect {
            Normalized::Redirect(joined.into_owned())
        } else {
            Normalized::Path(joined)
        }
    }
}

fn has_escaped_slash(path: &str) -> bool {
    let bytes = path.as_bytes();
    bytes.windows(3).any(|w| {
        w[0] == b'%' && w[1] == b'2' && (w[2] == b'f' || w[2] == b'F')
            || w[0] == b'%' && w[1] == b'5' && (w[2] == b'c' || w[2] == b'C')
    })
}

fn unescape_slashes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        match tail.get(..3) {
            Some(e) if e.eq_ignore_ascii_case("%2f") => out.push('/'),
            Some(e) if e.eq_ignore_ascii_case("%5c") => out.push('\\'),
            _ => {
                out.push('%');
                rest = &tail[1..];
                continue;
            }
        }
        rest = &tail[3..];
    }
    out.push_str(rest);
    out
}

fn merge_slashes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if c == '/' && out.ends_with('/') {
            continue;
        }
        out.push(c);
    }
    out
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// One segment with its escapes canonicalized: unreserved characters decoded, other
/// escapes upper-cased, bytes a path may not carry escaped.
fn canonical_segment(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = String::with_capacity(segment.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%'
            && let (Some(h), Some(l)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            let decoded = h * 16 + l;
            if unreserved(decoded) {
                out.push(decoded as char);
            } else {
                out.push_str(&format!("%{decoded:02X}"));
            }
            i += 3;
            continue;
        }
        if b.is_ascii_control()
            || b == b' '
            || b >= 0x80
            || matches!(b, b'"' | b'<' | b'>' | b'`' | b'{' | b'}')
        {
            out.push_str(&format!("%{b:02X}"));
        } else {
            out.push(b as char);
        }
        i += 1;
    }
    out
}

/// Envoy's `PathUtil::canonicalPath` on a path without its query: `None` when it
/// cannot be canonicalized.
pub fn canonical_path(path: &str) -> Option<String> {
    let path = path.replace('\\', "/");
    let mut segments: Vec<String> = Vec::new();
    let raw: Vec<&str> = path.split('/').skip(1).collect();
    let last = raw.len().saturating_sub(1);
    for (i, segment) in raw.iter().enumerate() {
        let canonical = canonical_segment(segment);
        match canonical.as_str() {
            "." => {
                if i == last {
                    segments.push(String::new());
                }
            }
            ".." => {
                segments.pop();
                if i == last {
                    segments.push(String::new());
                }
            }
            _ => segments.push(canonical),
        }
    }
    let mut out = String::with_capacity(path.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if out.is_empty() {
        out.push('/');
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normalized(config: PathNormalization, path: &str) -> Normalized<'_> {
        config.apply(path)
    }

    #[test]
    fn dot_segments_escapes_and_slashes() {
        let n = PathNormalization {
            normalize_path: true,
            ..Default::default()
        };
        for (input, want) in [
            ("/a/../b", "/b"),
            ("/a/./b", "/a/b"),
            ("/a/%2e%2e/b", "/b"),
            ("/a/%2E./b?x=/../y", "/b?x=/../y"),
            ("/..", "/"),
            ("/a/b/..", "/a/"),
            ("/a/.", "/a/"),
            ("/a//b", "/a//b"),
            ("/a\\b", "/a/b"),
            ("/%41%7e%2f", "/A~%2F"),
            ("/a%2fb", "/a%2Fb"),
            ("/plain", "/plain"),
        ] {
            assert_eq!(
                normalized(n, input),
                Normalized::Path(Cow::Owned(want.to_owned())),
                "{input}"
            );
        }
        let merge = PathNormalization {
            normalize_path: true,
            merge_slashes: true,
            ..Default::default()
        };
        assert_eq!(
            normalized(merge, "//a///b/"),
            Normalized::Path(Cow::Owned("/a/b/".to_owned()))
        );
    }

    #[test]
    fn escaped_slash_actions() {
        let with = |escaped_slashes| PathNormalization {
            escaped_slashes,
            ..Default::default()
        };
        assert_eq!(
            normalized(with(EscapedSlashes::RejectRequest), "/a%2Fb"),
            Normalized::Reject
        );
        assert_eq!(
            normalized(with(EscapedSlashes::UnescapeAndForward), "/a%2fb%5Cc?q=%2F"),
            Normalized::Path(Cow::Owned("/a/b\\c?q=%2F".to_owned()))
        );
        assert_eq!(
            normalized(with(EscapedSlashes::UnescapeAndRedirect), "/a%2Fb"),
            Normalized::Redirect("/a/b".to_owned())
        );
        assert_eq!(
            normalized(with(EscapedSlashes::KeepUnchanged), "/a%2Fb"),
            Normalized::Path(Cow::Borrowed("/a%2Fb"))
        );
    }
}
