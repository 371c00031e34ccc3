//! The subset of CEL (Common Expression Language) Istio users write in a Telemetry's
//! `accessLogging.filter.expression`, which istiod hands to Envoy's
//! `envoy.access_loggers.extension_filters.cel`: attribute paths (`response.code`,
//! `request.headers['x-user']`, `connection.mtls`), literals, comparisons, arithmetic,
//! `!`, `&&`, `||`, `? :`, `in`, lists, and the functions `size`, `has`, `int`,
//! `uint`, `string`, `startsWith`, `endsWith`, `contains` and `matches`.
//!
//! An expression is parsed once, when the config is compiled; what it does not support
//! is an error naming the construct. Evaluation reads attributes through a
//! [`Attributes`] resolver and follows CEL: a missing map key or a type mismatch is an
//! error, which `&&` and `||` absorb when their other side decides the result.

use std::fmt;

use regex::Regex;

/// A CEL value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    String(String),
    List(Vec<Value>),
    /// String keys only (headers, filter state).
    Map(Vec<(String, Value)>),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Uint(_) => "uint",
            Value::Double(_) => "double",
            Value::String(_) => "string",
            Value::List(_) => "list",
            Value::Map(_) => "map",
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(i) => Some(*i as f64),
            Value::Uint(u) => Some(*u as f64),
            Value::Double(d) => Some(*d),
            _ => None,
        }
    }
}

/// Why an evaluation produced no value (the access log filter then drops the entry, as
/// Envoy's does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalError(pub String);

impl fmt::Display for EvalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

type Eval = Result<Value, EvalError>;

fn err<T>(text: impl Into<String>) -> Result<T, EvalError> {
    Err(EvalError(text.into()))
}

/// What an expression reads: the value of `root.field` (`request.path`), `None` when
/// the attribute has no value for this entry (then it is an error, as in Envoy).
pub trait Attributes {
    fn get(&self, root: &str, field: &str) -> Option<Value>;
}

/// The attributes Envoy's CEL offers, by root: what the parser accepts.
const KNOWN: &[(&str, &[&str])] = &[
    (
        "request",
        &[
            "path",
            "url_path",
            "host",
            "scheme",
            "method",
            "headers",
            "referer",
            "useragent",
            "id",
            "protocol",
            "query",
            "duration",
            "size",
            "total_size",
        ],
    ),
    (
        "response",
        &[
            "code",
            "code_details",
            "flags",
            "grpc_status",
            "headers",
            "size",
            "total_size",
        ],
    ),
    ("source", &["address", "port"]),
    ("destination", &["address", "port"]),
    (
        "connection",
        &[
            "mtls",
            "requested_server_name",
            "tls_version",
            "subject_local_certificate",
            "subject_peer_certificate",
            "dns_san_local_certificate",
            "dns_san_peer_certificate",
            "uri_san_local_certificate",
            "uri_san_peer_certificate",
            "termination_details",
        ],
    ),
    (
        "upstream",
        &[
            "address",
            "port",
            "uri_san_peer_certificate",
            "uri_san_local_certificate",
            "transport_failure_reason",
        ],
    ),
    ("xds", &["cluster_name"]),
];

/// The parsed expression.
#[derive(Debug, Clone)]
pub struct Program {
    root: Expr,
    text: String,
}

#[derive(Debug, Clone)]
enum Expr {
    Literal(Value),
    /// `root.field`, checked against [`KNOWN`] when parsed.
    Attribute(&'static str, &'static str),
    /// `filter_state` (a map of the entry's filter state strings).
    FilterState,
    Index(Box<Expr>, Box<Expr>),
    /// `has(root.field)` or `has(map.key)`.
    Has(Box<Expr>),
    List(Vec<Expr>),
    Unary(UnaryOp, Box<Expr>),
    Binary(BinaryOp, Box<Expr>, Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Conditional(Box<Expr>, Box<Expr>, Box<Expr>),
    Call(Function, Vec<Expr>),
    /// `matches` with a literal pattern, compiled once.
    Matches(Box<Expr>, Box<Regex>),
}

#[derive(Debug, Clone, Copy)]
enum UnaryOp {
    Not,
    Negate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BinaryOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    In,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Function {
    Size,
    Int,
    Uint,
    String,
    StartsWith,
    EndsWith,
    Contains,
}

impl Program {
    /// Parses `text`; the error names the construct shunt does not support, and where.
    pub fn parse(text: &str) -> Result<Program, String> {
        let tokens = lex(text)?;
        let mut parser = Parser { tokens, at: 0 };
        let root = parser.conditional()?;
        if let Some(token) = parser.peek() {
            return Err(format!("unexpected {token} after the expression"));
        }
        Ok(Program {
            root,
            text: text.to_owned(),
        })
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// The expression's value for one entry.
    pub fn eval(&self, attributes: &dyn Attributes) -> Eval {
        eval(&self.root, attributes)
    }

    /// Whether the expression is `true` for one entry (an error or a non-bool is not).
    pub fn matches(&self, attributes: &dyn Attributes) -> bool {
        matches!(self.eval(attributes), Ok(Value::Bool(true)))
    }
}

// ---- lexing ----

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(String),
    Punct(&'static str),
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Ident(name) => write!(f, "{name:?}"),
            Token::Int(i) => write!(f, "{i}"),
            Token::Uint(u) => write!(f, "{u}u"),
            Token::Double(d) => write!(f, "{d}"),
            Token::Str(s) => write!(f, "{s:?}"),
            Token::Punct(p) => write!(f, "'{p}'"),
        }
    }
}

const PUNCTS: &[&str] = &[
    "&&", "||", "==", "!=", "<=", ">=", "<", ">", "!", "+", "-", "*", "/", "%", "(", ")", "[", "]",
    ".", ",", "?", ":", "{", "}",
];

fn lex(text: &str) -> Result<Vec<Token>, String> {
    let mut tokens = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            tokens.push(Token::Ident(text[start..i].to_owned()));
        } else if c.is_ascii_digit() {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'.') {
                // A `.` is part of the number only before a digit (`1.5`, not `1.size`).
                if bytes[i] == b'.' && !bytes.get(i + 1).is_some_and(u8::is_ascii_digit) {
                    break;
                }
                i += 1;
            }
            tokens.push(number(&text[start..i])?);
        } else if c == b'\'' || c == b'"' {
            let (value, next) = string_literal(text, i)?;
            tokens.push(Token::Str(value));
            i = next;
        } else if let Some(p) = PUNCTS.iter().find(|p| text[i..].starts_with(**p)) {
            tokens.push(Token::Punct(p));
            i += p.len();
        } else {
            let c = text[i..].chars().next().unwrap_or('?');
            return Err(format!("unexpected character {c:?} at offset {i}"));
        }
    }
    Ok(tokens)
}

fn number(text: &str) -> Result<Token, String> {
    let bad = || format!("{text:?} is not a number");
    if let Some(hex) = text.strip_prefix("0x") {
        return i64::from_str_radix(hex, 16)
            .map(Token::Int)
            .map_err(|_| bad());
    }
    if let Some(u) = text.strip_suffix(['u', 'U']) {
        return u.parse().map(Token::Uint).map_err(|_| bad());
    }
    if text.contains(['.', 'e', 'E']) {
        return text.parse().map(Token::Double).map_err(|_| bad());
    }
    text.parse().map(Token::Int).map_err(|_| bad())
}

/// A quoted string from `start` (its quote): the value and the offset after it.
fn string_literal(text: &str, start: usize) -> Result<(String, usize), String> {
    let quote = text.as_bytes()[start] as char;
    let mut out = String::new();
    let mut chars = text[start + 1..].char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some((_, 'n')) => out.push('\n'),
                Some((_, 't')) => out.push('\t'),
                Some((_, 'r')) => out.push('\r'),
                Some((_, other @ ('\\' | '\'' | '"'))) => out.push(other),
                Some((_, other)) => return Err(format!("the escape \\{other} is not supported")),
                None => break,
            },
            c if c == quote => return Ok((out, start + 1 + i + 1)),
            c => out.push(c),
        }
    }
    Err(format!("a string starting at offset {start} is not closed"))
}

// ---- parsing ----

struct Parser {
    tokens: Vec<Token>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn next(&mut self) -> Option<Token> {
        let token = self.tokens.get(self.at).cloned();
        self.at += 1;
        token
    }

    fn eat(&mut self, punct: &str) -> bool {
        if self.is(punct) {
            self.at += 1;
            return true;
        }
        false
    }

    fn expect(&mut self, punct: &str) -> Result<(), String> {
        if matches!(self.peek(), Some(Token::Punct(p)) if *p == punct) {
            self.at += 1;
            return Ok(());
        }
        Err(match self.peek() {
            Some(token) => format!("expected '{punct}', found {token}"),
            None => format!("expected '{punct}' at the end"),
        })
    }

    fn is(&self, punct: &str) -> bool {
        matches!(self.peek(), Some(Token::Punct(p)) if *p == punct)
    }

    fn conditional(&mut self) -> Result<Expr, String> {
        let condition = self.or()?;
        if !self.is("?") {
            return Ok(condition);
        }
        self.at += 1;
        let then = self.or()?;
        self.expect(":")?;
        let otherwise = self.conditional()?;
        Ok(Expr::Conditional(
            Box::new(condition),
            Box::new(then),
            Box::new(otherwise),
        ))
    }

    fn or(&mut self) -> Result<Expr, String> {
        let mut left = self.and()?;
        while self.is("||") {
            self.at += 1;
            left = Expr::Or(Box::new(left), Box::new(self.and()?));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Expr, String> {
        let mut left = self.relation()?;
        while self.is("&&") {
            self.at += 1;
            left = Expr::And(Box::new(left), Box::new(self.relation()?));
        }
        Ok(left)
    }

    fn relation(&mut self) -> Result<Expr, String> {
        let mut left = self.addition()?;
        loop {
            let op = match self.peek() {
                Some(Token::Punct("==")) => BinaryOp::Eq,
                Some(Token::Punct("!=")) => BinaryOp::Ne,
                Some(Token::Punct("<")) => BinaryOp::Lt,
                Some(Token::Punct("<=")) => BinaryOp::Le,
                Some(Token::Punct(">")) => BinaryOp::Gt,
                Some(Token::Punct(">=")) => BinaryOp::Ge,
                Some(Token::Ident(word)) if word == "in" => BinaryOp::In,
                _ => return Ok(left),
            };
            self.at += 1;
            left = Expr::Binary(op, Box::new(left), Box::new(self.addition()?));
        }
    }

    fn addition(&mut self) -> Result<Expr, String> {
        let mut left = self.multiplication()?;
        loop {
            let op = match self.peek() {
                Some(Token::Punct("+")) => BinaryOp::Add,
                Some(Token::Punct("-")) => BinaryOp::Sub,
                _ => return Ok(left),
            };
            self.at += 1;
            left = Expr::Binary(op, Box::new(left), Box::new(self.multiplication()?));
        }
    }

    fn multiplication(&mut self) -> Result<Expr, String> {
        let mut left = self.unary()?;
        loop {
            let op = match self.peek() {
                Some(Token::Punct("*")) => BinaryOp::Mul,
                Some(Token::Punct("/")) => BinaryOp::Div,
                Some(Token::Punct("%")) => BinaryOp::Rem,
                _ => return Ok(left),
            };
            self.at += 1;
            left = Expr::Binary(op, Box::new(left), Box::new(self.unary()?));
        }
    }

    fn unary(&mut self) -> Result<Expr, String> {
        if self.eat("!") {
            return Ok(Expr::Unary(UnaryOp::Not, Box::new(self.unary()?)));
        }
        if self.eat("-") {
            return Ok(Expr::Unary(UnaryOp::Negate, Box::new(self.unary()?)));
        }
        self.member()
    }

    /// A primary and its `.field`, `[index]` and `.method(args)` suffixes.
    fn member(&mut self) -> Result<Expr, String> {
        let mut expr = self.primary()?;
        loop {
            if self.eat("[") {
                let index = self.conditional()?;
                self.expect("]")?;
                expr = Expr::Index(Box::new(expr), Box::new(index));
            } else if self.eat(".") {
                let Some(Token::Ident(name)) = self.next() else {
                    return Err("expected a field or method name after '.'".into());
                };
                if self.eat("(") {
                    let mut args = vec![expr];
                    args.extend(self.arguments()?);
                    expr = call(&name, args)?;
                } else {
                    expr = select(expr, &name)?;
                }
            } else {
                return Ok(expr);
            }
        }
    }

    fn arguments(&mut self) -> Result<Vec<Expr>, String> {
        let mut args = Vec::new();
        if self.eat(")") {
            return Ok(args);
        }
        loop {
            args.push(self.conditional()?);
            if self.eat(")") {
                return Ok(args);
            }
            self.expect(",")?;
        }
    }

    fn primary(&mut self) -> Result<Expr, String> {
        let token = self.next().ok_or("the expression ends too early")?;
        Ok(match token {
            Token::Int(i) => Expr::Literal(Value::Int(i)),
            Token::Uint(u) => Expr::Literal(Value::Uint(u)),
            Token::Double(d) => Expr::Literal(Value::Double(d)),
            Token::Str(s) => Expr::Literal(Value::String(s)),
            Token::Punct("(") => {
                let inner = self.conditional()?;
                self.expect(")")?;
                inner
            }
            Token::Punct("[") => {
                let mut items = Vec::new();
                if !self.eat("]") {
                    loop {
                        items.push(self.conditional()?);
                        if self.eat("]") {
                            break;
                        }
                        self.expect(",")?;
                    }
                }
                Expr::List(items)
            }
            Token::Punct("{") => return Err("map literals are not supported by shunt".into()),
            Token::Punct(p) => return Err(format!("unexpected '{p}'")),
            Token::Ident(name) => match name.as_str() {
                "true" => Expr::Literal(Value::Bool(true)),
                "false" => Expr::Literal(Value::Bool(false)),
                "null" => Expr::Literal(Value::Null),
                "filter_state" => Expr::FilterState,
                _ if self.eat("(") => {
                    if name == "has" {
                        let args = self.arguments()?;
                        let [arg] = <[Expr; 1]>::try_from(args)
                            .map_err(|_| "has() takes one field selection".to_owned())?;
                        if !matches!(arg, Expr::Attribute(..) | Expr::Index(..)) {
                            return Err(
                                "has() takes a field selection like has(request.host)".into()
                            );
                        }
                        Expr::Has(Box::new(arg))
                    } else {
                        let args = self.arguments()?;
                        call(&name, args)?
                    }
                }
                root if KNOWN.iter().any(|(r, _)| *r == root) => {
                    // A root alone is a map shunt does not build: it needs a field.
                    self.expect(".").map_err(|_| {
                        format!("the attribute {root} needs a field ({root}.<field>)")
                    })?;
                    let Some(Token::Ident(field)) = self.next() else {
                        return Err(format!("expected a field name after {root}."));
                    };
                    attribute(root, &field)?
                }
                other => {
                    return Err(format!(
                        "the identifier {other:?} is not an attribute shunt supports"
                    ));
                }
            },
        })
    }
}

fn attribute(root: &str, field: &str) -> Result<Expr, String> {
    let (root, fields) = KNOWN
        .iter()
        .find(|(r, _)| *r == root)
        .ok_or_else(|| format!("the attribute {root} is not supported by shunt"))?;
    let field = fields
        .iter()
        .find(|f| **f == field)
        .ok_or_else(|| format!("the attribute {root}.{field} is not supported by shunt"))?;
    Ok(Expr::Attribute(root, field))
}

/// `expr.name` where `expr` is not a root: a map key (`filter_state.x`).
fn select(expr: Expr, name: &str) -> Result<Expr, String> {
    match expr {
        Expr::FilterState | Expr::Index(..) | Expr::Attribute(_, "headers") => Ok(Expr::Index(
            Box::new(expr),
            Box::new(Expr::Literal(Value::String(name.to_owned()))),
        )),
        _ => Err(format!(".{name} on this value is not supported by shunt")),
    }
}

fn call(name: &str, mut args: Vec<Expr>) -> Result<Expr, String> {
    let (function, arity) = match name {
        "size" => (Function::Size, 1),
        "int" => (Function::Int, 1),
        "uint" => (Function::Uint, 1),
        "string" => (Function::String, 1),
        "startsWith" => (Function::StartsWith, 2),
        "endsWith" => (Function::EndsWith, 2),
        "contains" => (Function::Contains, 2),
        "matches" => {
            if args.len() != 2 {
                return Err("matches() takes one pattern".into());
            }
            let Expr::Literal(Value::String(pattern)) = args.pop().expect("two arguments") else {
                return Err("matches() needs a literal pattern in shunt".into());
            };
            let regex = Regex::new(&pattern)
                .map_err(|e| format!("matches({pattern:?}): not a valid pattern: {e}"))?;
            let target = args.pop().expect("two arguments");
            return Ok(Expr::Matches(Box::new(target), Box::new(regex)));
        }
        other => return Err(format!("the function {other}() is not supported by shunt")),
    };
    if args.len() != arity {
        return Err(format!("{name}() takes {} argument(s)", arity - 1));
    }
    Ok(Expr::Call(function, args))
}

// ---- evaluation ----

fn eval(expr: &Expr, attributes: &dyn Attributes) -> Eval {
    match expr {
        Expr::Literal(value) => Ok(value.clone()),
        Expr::Attribute(root, field) => attributes
            .get(root, field)
            .map_or_else(|| err(format!("no such attribute: {root}.{field}")), Ok),
        Expr::FilterState => Ok(attributes
            .get("filter_state", "")
            .unwrap_or(Value::Map(vec![]))),
        Expr::Index(target, index) => {
            let target = eval(target, attributes)?;
            let index = eval(index, attributes)?;
            self::index(&target, &index)
        }
        Expr::Has(selection) => Ok(Value::Bool(eval(selection, attributes).is_ok())),
        Expr::List(items) => items
            .iter()
            .map(|item| eval(item, attributes))
            .collect::<Result<_, _>>()
            .map(Value::List),
        Expr::Unary(UnaryOp::Not, inner) => match eval(inner, attributes)? {
            Value::Bool(b) => Ok(Value::Bool(!b)),
            other => err(format!("no such overload: !{}", other.type_name())),
        },
        Expr::Unary(UnaryOp::Negate, inner) => match eval(inner, attributes)? {
            Value::Int(i) => i
                .checked_neg()
                .map(Value::Int)
                .ok_or(EvalError("overflow".into())),
            Value::Double(d) => Ok(Value::Double(-d)),
            other => err(format!("no such overload: -{}", other.type_name())),
        },
        Expr::And(left, right) => logical(left, right, false, attributes),
        Expr::Or(left, right) => logical(left, right, true, attributes),
        Expr::Conditional(condition, then, otherwise) => match eval(condition, attributes)? {
            Value::Bool(true) => eval(then, attributes),
            Value::Bool(false) => eval(otherwise, attributes),
            other => err(format!("a condition is a {}", other.type_name())),
        },
        Expr::Binary(op, left, right) => {
            let left = eval(left, attributes)?;
            let right = eval(right, attributes)?;
            binary(*op, &left, &right)
        }
        Expr::Call(function, args) => {
            let args = args
                .iter()
                .map(|arg| eval(arg, attributes))
                .collect::<Result<Vec<_>, _>>()?;
            apply(*function, &args)
        }
        Expr::Matches(target, regex) => match eval(target, attributes)? {
            Value::String(s) => Ok(Value::Bool(regex.is_match(&s))),
            other => err(format!("no such overload: {}.matches()", other.type_name())),
        },
    }
}

/// `&&` (`decides` false) and `||` (`decides` true): either side's deciding value wins
/// over an error on the other, as in CEL.
fn logical(left: &Expr, right: &Expr, decides: bool, attributes: &dyn Attributes) -> Eval {
    let as_bool = |value: Eval| match value {
        Ok(Value::Bool(b)) => Ok(b),
        Ok(other) => err(format!(
            "no such overload: {} in a logical operator",
            other.type_name()
        )),
        Err(e) => Err(e),
    };
    let left = as_bool(eval(left, attributes));
    if left == Ok(decides) {
        return Ok(Value::Bool(decides));
    }
    let right = as_bool(eval(right, attributes));
    if right == Ok(decides) {
        return Ok(Value::Bool(decides));
    }
    left?;
    right?;
    Ok(Value::Bool(!decides))
}

fn index(target: &Value, index: &Value) -> Eval {
    match (target, index) {
        (Value::Map(entries), Value::String(key)) => entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .map_or_else(|| err(format!("no such key: {key:?}")), Ok),
        (Value::List(items), Value::Int(i)) => usize::try_from(*i)
            .ok()
            .and_then(|i| items.get(i))
            .cloned()
            .map_or_else(|| err(format!("index {i} out of range")), Ok),
        (target, index) => err(format!(
            "no such overload: {}[{}]",
            target.type_name(),
            index.type_name()
        )),
    }
}

fn binary(op: BinaryOp, left: &Value, right: &Value) -> Eval {
    use std::cmp::Ordering;
    let order = || -> Result<Ordering, EvalError> {
        match (left, right) {
            (Value::String(a), Value::String(b)) => Ok(a.cmp(b)),
            (Value::Bool(a), Value::Bool(b)) => Ok(a.cmp(b)),
            (Value::Int(a), Value::Int(b)) => Ok(a.cmp(b)),
            (Value::Uint(a), Value::Uint(b)) => Ok(a.cmp(b)),
            _ => match (left.as_f64(), right.as_f64()) {
                (Some(a), Some(b)) => a
                    .partial_cmp(&b)
                    .ok_or(EvalError("NaN is not ordered".into())),
                _ => err(format!(
                    "no such overload: {} compared with {}",
                    left.type_name(),
                    right.type_name()
                )),
            },
        }
    };
    let equal = || -> bool {
        match (left.as_f64(), right.as_f64()) {
            (Some(a), Some(b)) => a == b,
            _ => left == right,
        }
    };
    Ok(match op {
        BinaryOp::Eq => Value::Bool(equal()),
        BinaryOp::Ne => Value::Bool(!equal()),
        BinaryOp::Lt => Value::Bool(order()?.is_lt()),
        BinaryOp::Le => Value::Bool(order()?.is_le()),
        BinaryOp::Gt => Value::Bool(order()?.is_gt()),
        BinaryOp::Ge => Value::Bool(order()?.is_ge()),
        BinaryOp::In => match right {
            Value::List(items) => Value::Bool(
                items
                    .iter()
                    .any(|item| binary(BinaryOp::Eq, left, item) == Ok(Value::Bool(true))),
            ),
            Value::Map(entries) => match left {
                Value::String(key) => Value::Bool(entries.iter().any(|(k, _)| k == key)),
                _ => Value::Bool(false),
            },
            other => return err(format!("no such overload: in {}", other.type_name())),
        },
        BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div | BinaryOp::Rem => {
            return arithmetic(op, left, right);
        }
    })
}

fn arithmetic(op: BinaryOp, left: &Value, right: &Value) -> Eval {
    let overflow = || EvalError("arithmetic overflow or division by zero".into());
    match (left, right) {
        (Value::Int(a), Value::Int(b)) => match op {
            BinaryOp::Add => a.checked_add(*b),
            BinaryOp::Sub => a.checked_sub(*b),
            BinaryOp::Mul => a.checked_mul(*b),
            BinaryOp::Div => a.checked_div(*b),
            _ => a.checked_rem(*b),
        }
        .map(Value::Int)
        .ok_or_else(overflow),
        (Value::Uint(a), Value::Uint(b)) => match op {
            BinaryOp::Add => a.checked_add(*b),
            BinaryOp::Sub => a.checked_sub(*b),
            BinaryOp::Mul => a.checked_mul(*b),
            BinaryOp::Div => a.checked_div(*b),
            _ => a.checked_rem(*b),
        }
        .map(Value::Uint)
        .ok_or_else(overflow),
        (Value::Double(a), Value::Double(b)) => Ok(Value::Double(match op {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            _ => return err("no such overload: double % double"),
        })),
        (Value::String(a), Value::String(b)) if op == BinaryOp::Add => {
            Ok(Value::String(format!("{a}{b}")))
        }
        (Value::List(a), Value::List(b)) if op == BinaryOp::Add => {
            Ok(Value::List(a.iter().chain(b).cloned().collect()))
        }
        _ => err(format!(
            "no such overload: {} {op:?} {}",
            left.type_name(),
            right.type_name()
        )),
    }
}

fn apply(function: Function, args: &[Value]) -> Eval {
    match (function, args) {
        (Function::Size, [Value::String(s)]) => Ok(Value::Int(s.chars().count() as i64)),
        (Function::Size, [Value::List(l)]) => Ok(Value::Int(l.len() as i64)),
        (Function::Size, [Value::Map(m)]) => Ok(Value::Int(m.len() as i64)),
        (Function::Int, [Value::Int(i)]) => Ok(Value::Int(*i)),
        (Function::Int, [Value::Uint(u)]) => i64::try_from(*u)
            .map(Value::Int)
            .map_err(|_| EvalError("int() overflow".into())),
        (Function::Int, [Value::Double(d)]) => Ok(Value::Int(*d as i64)),
        (Function::Int, [Value::String(s)]) => s
            .parse()
            .map(Value::Int)
            .map_err(|_| EvalError(format!("int({s:?}): not an integer"))),
        (Function::Uint, [Value::Uint(u)]) => Ok(Value::Uint(*u)),
        (Function::Uint, [Value::Int(i)]) => u64::try_from(*i)
            .map(Value::Uint)
            .map_err(|_| EvalError("uint() of a negative int".into())),
        (Function::Uint, [Value::String(s)]) => s
            .parse()
            .map(Value::Uint)
            .map_err(|_| EvalError(format!("uint({s:?}): not an integer"))),
        (Function::String, [value]) => Ok(Value::String(match value {
            Value::String(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            Value::Uint(u) => u.to_string(),
            Value::Double(d) => d.to_string(),
            Value::Bool(b) => b.to_string(),
            other => return err(format!("no such overload: string({})", other.type_name())),
        })),
        (Function::StartsWith, [Value::String(s), Value::String(p)]) => {
            Ok(Value::Bool(s.starts_with(p.as_str())))
        }
        (Function::EndsWith, [Value::String(s), Value::String(p)]) => {
            Ok(Value::Bool(s.ends_with(p.as_str())))
        }
        (Function::Contains, [Value::String(s), Value::String(p)]) => {
            Ok(Value::Bool(s.contains(p.as_str())))
        }
        (function, args) => err(format!(
            "no such overload: {function:?}({})",
            args.iter()
                .map(Value::type_name)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;

    impl Attributes for Fixed {
        fn get(&self, root: &str, field: &str) -> Option<Value> {
            Some(match (root, field) {
                ("response", "code") => Value::Int(503),
                ("request", "path") => Value::String("/api/v1/items?x=1".into()),
                ("request", "method") => Value::String("GET".into()),
                ("request", "headers") => {
                    Value::Map(vec![("x-user".into(), Value::String("alice".into()))])
                }
                ("connection", "mtls") => Value::Bool(true),
                _ => return None,
            })
        }
    }

    fn eval_text(text: &str) -> Eval {
        Program::parse(text)
            .unwrap_or_else(|e| panic!("{text}: {e}"))
            .eval(&Fixed)
    }

    #[test]
    fn what_istio_users_write_evaluates_as_cel_does() {
        for (text, expected) in [
            ("response.code >= 400", true),
            ("response.code >= 400 && connection.mtls", true),
            ("!connection.mtls || response.code == 200", false),
            ("request.headers['x-user'] == 'alice'", true),
            ("request.headers['x-missing'] == 'a' || true", true),
            ("request.path.startsWith('/api')", true),
            ("request.path.endsWith('items')", false),
            ("request.path.contains('v1')", true),
            ("request.method in ['GET', 'HEAD']", true),
            ("'x-user' in request.headers", true),
            (
                "size(request.method) == 3 && request.method.size() == 3",
                true,
            ),
            ("has(request.headers.x_user)", false),
            ("has(request.headers['x-user'])", true),
            ("response.code / 100 == 5", true),
            ("response.code == 503u", true),
            ("request.path.matches('^/api/v[0-9]+/')", true),
            ("response.code > 500 ? true : false", true),
            ("string(response.code) == '503'", true),
        ] {
            assert_eq!(eval_text(text), Ok(Value::Bool(expected)), "{text}");
        }
        // A missing key is an error, which a filter treats as "do not log".
        assert!(eval_text("request.headers['x-missing'] == 'a'").is_err());
        assert!(
            !Program::parse("request.headers['x-missing'] == 'a'")
                .unwrap()
                .matches(&Fixed)
        );
    }

    #[test]
    fn unsupported_constructs_are_named() {
        for (text, says) in [
            ("request.nope == 1", "request.nope is not supported"),
            ("foo.bar", "\"foo\" is not an attribute"),
            (
                "request.path.lowerAscii() == 'a'",
                "lowerAscii() is not supported",
            ),
            ("{'a': 1}", "map literals"),
            ("response.code >", "ends too early"),
            ("response.code == 'a", "not closed"),
            ("request", "needs a field"),
        ] {
            let error = Program::parse(text).expect_err(text);
            assert!(error.contains(says), "{text}: {error}");
        }
    }
}
