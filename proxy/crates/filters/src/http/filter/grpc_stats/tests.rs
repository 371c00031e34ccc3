use envoy_types::pb::envoy::config::core::v3::GrpcMethodList;
use envoy_types::pb::envoy::config::core::v3::grpc_method_list::Service;
use envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::FilterConfig;
use envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::filter_config::PerMethodStatSpecifier;

use envoy_types::pb::google::protobuf::BoolValue;

use super::*;
use shunt_config::JsonPath;

fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(message);
    out
}

#[test]
fn messages_count_when_they_start_however_the_bytes_are_split() {
    let mut stream = frame(b"hello");
    stream.extend(frame(b""));
    stream.extend(frame(&[7; 300]));
    // Whole.
    let mut whole = FrameCounter::default();
    assert_eq!(whole.inspect(&stream), 3);
    // One byte at a time: the same count, each message when its flag byte comes.
    let mut bytes = FrameCounter::default();
    let starts: Vec<u64> = stream.iter().map(|b| bytes.inspect(&[*b])).collect();
    assert_eq!(bytes.count(), 3);
    assert_eq!(starts.iter().sum::<u64>(), 3);
    assert_eq!(starts[0], 1, "the first byte starts the first message");
    assert_eq!(starts[10], 1, "byte 10 is the empty message's flag");
    assert_eq!(starts[15], 1, "byte 15 is the third message's flag");
    // A message cut in its header.
    let mut cut = FrameCounter::default();
    assert_eq!(cut.inspect(&stream[..3]), 1);
    assert_eq!(cut.inspect(&stream[3..]), 2);
}

#[test]
fn service_and_method_need_exactly_two_parts() {
    assert_eq!(
        service_and_method("/helloworld.Greeter/SayHello"),
        Some(("helloworld.Greeter", "SayHello"))
    );
    assert_eq!(service_and_method("/a/b?x=1"), Some(("a", "b")));
    assert_eq!(service_and_method("/a"), None);
    assert_eq!(service_and_method("/a/b/c"), None);
    assert_eq!(service_and_method(""), None);
}

fn config(per_method: Option<PerMethodStatSpecifier>, replace_dots: bool) -> GrpcStatsConfig {
    let proto = FilterConfig {
        per_method_stat_specifier: per_method,
        replace_dots_in_grpc_service_name: replace_dots,
        ..FilterConfig::default()
    };
    let mut problems = Diagnostics::default();
    compile(&proto, &JsonPath::new("f"), &mut problems).expect("compiles")
}

#[test]
fn the_method_is_in_the_stat_name_as_configured() {
    let path = "/pkg.Svc/Do";
    assert_eq!(config(None, false).method_prefix(path).as_deref(), Some(""));
    let all = |v| Some(PerMethodStatSpecifier::StatsForAllMethods(v));
    assert_eq!(
        config(all(BoolValue { value: true }), false)
            .method_prefix(path)
            .as_deref(),
        Some("pkg.Svc.Do.")
    );
    assert_eq!(
        config(all(BoolValue { value: true }), true)
            .method_prefix(path)
            .as_deref(),
        Some("pkg_Svc.Do.")
    );
    assert_eq!(
        config(all(BoolValue { value: false }), false)
            .method_prefix(path)
            .as_deref(),
        Some("")
    );
    let allow = config(
        Some(PerMethodStatSpecifier::IndividualMethodStatsAllowlist(
            GrpcMethodList {
                services: vec![Service {
                    name: "pkg.Svc".into(),
                    method_names: vec!["Do".into()],
                }],
            },
        )),
        false,
    );
    assert_eq!(allow.method_prefix(path).as_deref(), Some("pkg.Svc.Do."));
    assert_eq!(allow.method_prefix("/pkg.Svc/Other").as_deref(), Some(""));
    assert_eq!(allow.method_prefix("/not-grpc"), None);
}

#[test]
fn grpc_content_types() {
    let with = |v: &'static str| {
        let mut h = HeaderMap::new();
        h.insert(hyper::header::CONTENT_TYPE, v.parse().unwrap());
        is_grpc_content_type(&h)
    };
    assert!(with("application/grpc"));
    assert!(with("application/grpc+proto"));
    assert!(with("application/grpc;charset=utf-8"));
    assert!(!with("application/grpc-web"));
    assert!(!with("application/json"));
    assert!(!is_grpc_content_type(&HeaderMap::new()));
}
