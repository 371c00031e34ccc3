//! Trace context on the wire: W3C `traceparent`/`tracestate` (OpenTelemetry) and B3
//! (`x-b3-*` and the single `b3` header, Zipkin), read from a request and written on
//! the request sent upstream, as Envoy's `SpanContextExtractor`s and `injectContext`
//! do.

use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

use super::span::SpanContext;

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
pub const B3: HeaderName = HeaderName::from_static("b3");
pub const X_B3_TRACE_ID: HeaderName = HeaderName::from_static("x-b3-traceid");
pub const X_B3_SPAN_ID: HeaderName = HeaderName::from_static("x-b3-spanid");
pub const X_B3_PARENT_SPAN_ID: HeaderName = HeaderName::from_static("x-b3-parentspanid");
pub const X_B3_SAMPLED: HeaderName = HeaderName::from_static("x-b3-sampled");
pub const X_B3_FLAGS: HeaderName = HeaderName::from_static("x-b3-flags");

/// What a request's W3C headers say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum W3c {
    /// No `traceparent`: a new trace.
    Absent,
    /// A `traceparent` Envoy cannot read: no span at all (Envoy's `NullSpan`).
    Invalid,
    /// The caller's span (its id is the new span's parent) and `tracestate`.
    Parent {
        trace_id: u128,
        span_id: u64,
        sampled: bool,
        trace_state: String,
    },
}

/// `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`) and the `tracestate` values joined.
pub fn extract_w3c(headers: &HeaderMap) -> W3c {
    let Some(value) = headers.get(TRACEPARENT) else {
        return W3c::Absent;
    };
    let Some((trace_id, span_id, sampled)) = value.to_str().ok().and_then(parse_traceparent) else {
        return W3c::Invalid;
    };
    let trace_state = headers
        .get_all(TRACESTATE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    W3c::Parent {
        trace_id,
        span_id,
        sampled,
        trace_state,
    }
}

fn parse_traceparent(value: &str) -> Option<(u128, u64, bool)> {
    let parts: Vec<&str> = value.split('-').collect();
    let [version, trace, span, flags] = parts[..] else {
        return None;
    };
    let lower_hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if !lower_hex(version, 2)
        || version == "ff"
        || !lower_hex(trace, 32)
        || !lower_hex(span, 16)
        || !lower_hex(flags, 2)
    {
        return None;
    }
    let trace_id = u128::from_str_radix(trace, 16).ok()?;
    let span_id = u64::from_str_radix(span, 16).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    (trace_id != 0 && span_id != 0).then_some((trace_id, span_id, flags & 1 == 1))
}

/// `traceparent` and `tracestate` for the request upstream (`tracestate` always, even
/// empty, as Envoy writes it).
pub fn inject_w3c(context: &SpanContext, trace_state: &str, headers: &mut HeaderMap) {
    let value = format!(
        "00-{:032x}-{:016x}-{}",
        context.trace_id,
        context.span_id,
        if context.sampled { "01" } else { "00" }
    );
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(TRACEPARENT, value);
    }
    if let Ok(value) = HeaderValue::from_str(trace_state) {
        headers.insert(TRACESTATE, value);
    }
}

/// What a request's B3 headers say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct B3Context {
    /// The caller's trace and span, when both are there.
    pub parent: Option<(u128, u64)>,
    /// `x-b3-sampled` / the single header's flag, when given.
    pub sampled: Option<bool>,
    /// `x-b3-flags: 1` or `d`: debug, always sampled.
    pub debug: bool,
    /// The request used the single `b3` header: the answer goes the same way.
    pub single: bool,
}

/// Malformed B3: Envoy's Zipkin extractor then starts no span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidB3;

pub fn extract_b3(headers: &HeaderMap) -> Result<B3Context, InvalidB3> {
    let text = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(single) = text(&B3) {
        return parse_single_b3(single);
    }
    let mut context = B3Context::default();
    if let Some(sampled) = text(&X_B3_SAMPLED) {
        context.sampled = Some(matches!(sampled, "1" | "true" | "d"));
    }
    if text(&X_B3_FLAGS) == Some("1") {
        context.debug = true;
    }
    match (text(&X_B3_TRACE_ID), text(&X_B3_SPAN_ID)) {
        (Some(trace), Some(span)) => {
            let trace = parse_trace_id(trace).ok_or(InvalidB3)?;
            let span = parse_id(span).ok_or(InvalidB3)?;
            context.parent = Some((trace, span));
        }
        (None, None) => {}
        _ => return Err(InvalidB3),
    }
    Ok(context)
}

/// `b3: {trace}-{span}[-{sampling}[-{parent}]]`, or only `{sampling}`.
fn parse_single_b3(value: &str) -> Result<B3Context, InvalidB3> {
    let sampling = |flag: &str| match flag {
        "1" => Ok((Some(true), false)),
        "0" => Ok((Some(false), false)),
        "d" => Ok((Some(true), true)),
        _ => Err(InvalidB3),
    };
    let parts: Vec<&str> = value.split('-').collect();
    let mut context = B3Context {
        single: true,
        ..B3Context::default()
    };
    if let [flag] = parts[..] {
        (context.sampled, context.debug) = sampling(flag)?;
        return Ok(context);
    }
    if parts.len() < 2 || parts.len() > 4 {
        return Err(InvalidB3);
    }
    let trace = parse_trace_id(parts[0]).ok_or(InvalidB3)?;
    let span = parse_id(parts[1]).ok_or(InvalidB3)?;
    context.parent = Some((trace, span));
    if let Some(flag) = parts.get(2) {
        (context.sampled, context.debug) = sampling(flag)?;
    }
    if let Some(parent) = parts.get(3) {
        parse_id(parent).ok_or(InvalidB3)?;
    }
    Ok(context)
}

fn parse_trace_id(s: &str) -> Option<u128> {
    (s.len() == 16 || s.len() == 32)
        .then(|| u128::from_str_radix(s, 16).ok())
        .flatten()
        .filter(|id| *id != 0)
}

fn parse_id(s: &str) -> Option<u64> {
    (s.len() == 16)
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
        .filter(|id| *id != 0)
}

/// The B3 headers of a span for the request upstream: the single header when the
/// request came with one, else `x-b3-*`.
pub fn inject_b3(
    context: &SpanContext,
    trace_id_128bit: bool,
    debug: bool,
    single: bool,
    headers: &mut HeaderMap,
) {
    let trace = if trace_id_128bit || context.trace_id > u128::from(u64::MAX) {
        format!("{:032x}", context.trace_id)
    } else {
        format!("{:016x}", context.trace_id)
    };
    let span = format!("{:016x}", context.span_id);
    let sampled = if context.sampled { "1" } else { "0" };
    let mut set = |name: HeaderName, value: String| {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    };
    if single {
        let mut value = format!("{trace}-{span}-{sampled}");
        if let Some(parent) = context.parent_id {
            value.push_str(&format!("-{parent:016x}"));
        }
        set(B3, value);
        return;
    }
    set(X_B3_TRACE_ID, trace);
    set(X_B3_SPAN_ID, span);
    if let Some(parent) = context.parent_id {
        set(X_B3_PARENT_SPAN_ID, format!("{parent:016x}"));
    }
    set(X_B3_SAMPLED, sampled.to_owned());
    if debug {
        set(X_B3_FLAGS, "1".to_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    #[test]
    fn a_traceparent_gives_the_parent_and_its_sampled_flag() {
        let h = headers(&[
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
            ),
            ("tracestate", "a=1"),
            ("tracestate", "b=2"),
        ]);
        assert_eq!(
            extract_w3c(&h),
            W3c::Parent {
                trace_id: 0x0af7651916cd43dd8448eb211c80319c,
                span_id: 0xb7ad6b7169203331,
                sampled: false,
                trace_state: "a=1,b=2".into()
            }
        );
    }

    #[test]
    fn a_malformed_traceparent_is_invalid_and_none_is_absent() {
        for bad in [
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
        ] {
            assert_eq!(
                extract_w3c(&headers(&[("traceparent", bad)])),
                W3c::Invalid,
                "{bad}"
            );
        }
        assert_eq!(extract_w3c(&HeaderMap::new()), W3c::Absent);
    }

    #[test]
    fn b3_single_and_multi_headers_read_alike() {
        let single = extract_b3(&headers(&[(
            "b3",
            "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1-e457b5a2e4d86bd1",
        )]))
        .unwrap();
        let multi = extract_b3(&headers(&[
            ("x-b3-traceid", "0af7651916cd43dd8448eb211c80319c"),
            ("x-b3-spanid", "b7ad6b7169203331"),
            ("x-b3-sampled", "1"),
        ]))
        .unwrap();
        assert_eq!(single.parent, multi.parent);
        assert_eq!((single.sampled, single.single), (Some(true), true));
        assert_eq!((multi.sampled, multi.single), (Some(true), false));
        assert_eq!(
            extract_b3(&headers(&[("b3", "0")])).unwrap().sampled,
            Some(false)
        );
        assert!(extract_b3(&headers(&[("x-b3-traceid", "0af7651916cd43dd")])).is_err());
    }

    #[test]
    fn b3_goes_upstream_in_the_form_it_came() {
        let context = SpanContext {
            trace_id: 0x0af7651916cd43dd8448eb211c80319c,
            span_id: 0xd754d34db74d1603,
            parent_id: Some(0xb8cb11f8f127476d),
            sampled: true,
        };
        let mut h = HeaderMap::new();
        inject_b3(&context, true, false, true, &mut h);
        assert_eq!(
            h["b3"],
            "0af7651916cd43dd8448eb211c80319c-d754d34db74d1603-1-b8cb11f8f127476d"
        );
        let mut h = HeaderMap::new();
        inject_b3(&context, true, false, false, &mut h);
        assert_eq!(h["x-b3-spanid"], "d754d34db74d1603");
        assert_eq!(h["x-b3-parentspanid"], "b8cb11f8f127476d");
        assert_eq!(h["x-b3-sampled"], "1");
        assert!(!h.contains_key("b3"));
    }
}
