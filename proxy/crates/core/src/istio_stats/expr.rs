//! The attribute expressions of the stats plugin's custom dimensions and definitions.
//! istio-proxy evaluates full CEL; what Istio's Telemetry API and its docs write is a
//! literal or an attribute path (`request.host`, `request.headers['user-agent']`,
//! `upstream_peer.labels['app']`, `node.metadata['MESH_ID']`, `request.total_size`), and
//! that subset is what shunt reads. Anything else does not parse, with a message saying
//! so, and is then handled as istio-proxy handles an expression that does not parse.

use std::fmt;

/// One step of an attribute path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// `.name` (or the first identifier).
    Field(String),
    /// `['key']` or `[0]`.
    Index(String),
}

/// A parsed expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    /// A string or integer literal.
    Literal(String),
    /// An attribute path: `request.headers['x']` is `[Field(request), Field(headers),
    /// Index(x)]`.
    Path(Vec<Segment>),
}

/// What an expression reads: the stream's attributes, by path. `None` when the attribute
/// is absent, which evaluates to `unknown` (istio-proxy's value for an evaluation error).
pub trait Attributes {
    fn attribute(&self, path: &[Segment]) -> Option<String>;
}

/// No attributes at all.
pub struct NoAttributes;

impl Attributes for NoAttributes {
    fn attribute(&self, _: &[Segment]) -> Option<String> {
        None
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub expression: String,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "expression {:?} is not supported: {} (shunt evaluates literals and attribute \
             paths such as request.headers['x'])",
            self.expression, self.message
        )
    }
}

impl std::error::Error for ParseError {}

impl Expr {
    pub fn parse(text: &str) -> Result<Expr, ParseError> {
        let fail = |message: &str| ParseError {
            expression: text.to_owned(),
            message: message.to_owned(),
        };
        let mut chars = Parser { rest: text.trim() };
        if chars.rest.is_empty() {
            return Err(fail("it is empty"));
        }
        let expr = if let Some(literal) = chars.string().map_err(|m| fail(&m))? {
            Expr::Literal(literal)
        } else if let Some(number) = chars.integer() {
            Expr::Literal(number)
        } else {
            let first = chars
                .identifier()
                .ok_or_else(|| fail("expected a literal or an attribute name"))?;
            let mut path = vec![Segment::Field(first)];
            loop {
                chars.skip_spaces();
                if chars.eat('.') {
                    chars.skip_spaces();
                    let field = chars
                        .identifier()
                        .ok_or_else(|| fail("expected a field name after '.'"))?;
                    path.push(Segment::Field(field));
                } else if chars.eat('[') {
                    chars.skip_spaces();
                    let key = match chars.string().map_err(|m| fail(&m))? {
                        Some(key) => key,
                        None => chars
                            .integer()
                            .ok_or_else(|| fail("expected a string or integer index"))?,
                    };
                    chars.skip_spaces();
                    if !chars.eat(']') {
                        return Err(fail("expected ']'"));
                    }
                    path.push(Segment::Index(key));
                } else {
                    break;
                }
            }
            Expr::Path(path)
        };
        chars.skip_spaces();
        if !chars.rest.is_empty() {
            return Err(fail(&format!("unexpected {:?}", chars.rest)));
        }
        Ok(expr)
    }

    /// The value as a label: `unknown` when the attribute is absent.
    pub fn evaluate(&self, attributes: &dyn Attributes) -> String {
        match self {
            Expr::Literal(value) => value.clone(),
            Expr::Path(path) => attributes
                .attribute(path)
                .unwrap_or_else(|| "unknown".to_owned()),
        }
    }

    /// The value as a metric amount: 0 unless it reads as an unsigned integer.
    pub fn evaluate_int(&self, attributes: &dyn Attributes) -> u64 {
        self.evaluate(attributes).parse().unwrap_or(0)
    }
}

struct Parser<'a> {
    rest: &'a str,
}

impl Parser<'_> {
    fn skip_spaces(&mut self) {
        self.rest = self.rest.trim_start();
    }

    fn eat(&mut self, c: char) -> bool {
        match self.rest.strip_prefix(c) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    fn identifier(&mut self) -> Option<String> {
        let end = self
            .rest
            .char_indices()
            .find(|&(i, c)| !(c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit())))
            .map_or(self.rest.len(), |(i, _)| i);
        if end == 0 {
            return None;
        }
        let (ident, rest) = self.rest.split_at(end);
        self.rest = rest;
        Some(ident.to_owned())
    }

    fn integer(&mut self) -> Option<String> {
        let end = self
            .rest
            .char_indices()
            .find(|&(_, c)| !c.is_ascii_digit())
            .map_or(self.rest.len(), |(i, _)| i);
        if end == 0 {
            return None;
        }
        let (digits, rest) = self.rest.split_at(end);
        // CEL's unsigned suffix.
        self.rest = rest.strip_prefix('u').unwrap_or(rest);
        Some(digits.to_owned())
    }

    /// A quoted string with `\\`, `\'` and `\"` escapes; `Ok(None)` when not at a quote.
    fn string(&mut self) -> Result<Option<String>, String> {
        let Some(quote) = self.rest.chars().next().filter(|c| *c == '\'' || *c == '"') else {
            return Ok(None);
        };
        let mut out = String::new();
        let mut chars = self.rest[1..].char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, escaped @ ('\\' | '\'' | '"'))) => out.push(escaped),
                    _ => return Err("unsupported escape in a string".to_owned()),
                },
                c if c == quote => {
                    self.rest = &self.rest[1 + i + 1..];
                    return Ok(Some(out));
                }
                c => out.push(c),
            }
        }
        Err("unterminated string".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;
    impl Attributes for Fixed {
        fn attribute(&self, path: &[Segment]) -> Option<String> {
            (path
                == [
                    Segment::Field("request".into()),
                    Segment::Field("headers".into()),
                    Segment::Index("user-agent".into()),
                ])
            .then(|| "curl".to_owned())
        }
    }

    #[test]
    fn literals_and_paths_parse_and_evaluate() {
        assert_eq!(
            Expr::parse("'fixed'").unwrap().evaluate(&NoAttributes),
            "fixed"
        );
        assert_eq!(
            Expr::parse(" 42u ").unwrap().evaluate_int(&NoAttributes),
            42
        );
        let header = Expr::parse("request.headers[\"user-agent\"]").unwrap();
        assert_eq!(header.evaluate(&Fixed), "curl");
        let absent = Expr::parse("upstream_peer.labels['app']").unwrap();
        assert_eq!(absent.evaluate(&Fixed), "unknown");
        assert_eq!(absent.evaluate_int(&Fixed), 0);
    }

    #[test]
    fn what_is_not_supported_is_named() {
        for text in ["", "a +", "a == b ? 'x' : 'y'", "'open", "a[", "x.1"] {
            let err = Expr::parse(text).unwrap_err();
            assert_eq!(err.expression, text);
            assert!(err.to_string().contains("not supported"), "{err}");
        }
    }
}
