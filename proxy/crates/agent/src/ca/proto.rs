//! Istio's CA API (`istio.v1.auth`, istio/api `security/v1alpha1/ca.proto`): two small
//! messages written out by hand rather than generated, with a test that holds them to
//! the `.proto` (tests/fixtures/istio/protos/ca.proto); and the one call, unary gRPC.

use envoy_types::pb::google::protobuf::Struct;

/// The full gRPC method path pilot-agent calls.
pub const CREATE_CERTIFICATE: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateRequest {
    /// The PEM-encoded CSR.
    #[prost(string, tag = "1")]
    pub csr: String,
    /// Requested lifetime in seconds; 0 leaves it to the CA.
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
    /// Opaque to the protocol; istiod reads [`IMPERSONATED_IDENTITY`] from it.
    #[prost(message, optional, tag = "4")]
    pub metadata: Option<Struct>,
}

/// The `metadata` key under which a node agent asks, with its own token, for another
/// identity (`spiffe://td/ns/ns/sa/sa`): ztunnel's, which istiod authorizes for the
/// workloads on the caller's node.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// `metadata` asking for `identity` on another's behalf.
pub fn impersonating(identity: &str) -> Struct {
    use envoy_types::pb::google::protobuf::{Value, value::Kind};
    Struct {
        fields: [(
            IMPERSONATED_IDENTITY.to_owned(),
            Value {
                kind: Some(Kind::StringValue(identity.to_owned())),
            },
        )]
        .into(),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateResponse {
    /// PEM certificates, leaf first, root last.
    #[prost(string, repeated, tag = "1")]
    pub cert_chain: Vec<String>,
}

/// `CreateCertificate` on `channel`, `request` carrying the caller's metadata.
pub async fn create_certificate(
    channel: tonic::transport::Channel,
    request: tonic::Request<IstioCertificateRequest>,
) -> Result<IstioCertificateResponse, tonic::Status> {
    let mut client = tonic::client::Grpc::new(channel);
    client
        .ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("CA connection: {e}")))?;
    let codec =
        tonic_prost::ProstCodec::<IstioCertificateRequest, IstioCertificateResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(CREATE_CERTIFICATE);
    client
        .unary(request, path, codec)
        .await
        .map(|r| r.into_inner())
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    const CA_PROTO: &str = include_str!("../../../../../tests/fixtures/istio/protos/ca.proto");

    /// Each field of `message` in ca.proto as (name, number, type name or type, repeated).
    fn fields(message: &str) -> Vec<(String, i32, String, bool)> {
        let file = protox_parse::parse("ca.proto", CA_PROTO).expect("ca.proto parses");
        let message = file
            .message_type
            .iter()
            .find(|m| m.name() == message)
            .unwrap_or_else(|| panic!("{message} in ca.proto"));
        message
            .field
            .iter()
            .map(|f| {
                (
                    f.name().to_owned(),
                    f.number(),
                    match f.type_name() {
                        "" => format!("{}", f.r#type.unwrap_or_default()),
                        name => name.trim_start_matches('.').to_owned(),
                    },
                    f.label == Some(3), // LABEL_REPEATED
                )
            })
            .collect()
    }

    // descriptor.proto's FieldDescriptorProto.Type values.
    const INT64: &str = "3";
    const STRING: &str = "9";

    #[test]
    fn the_messages_match_ca_proto() {
        assert_eq!(
            fields("IstioCertificateRequest"),
            [
                ("csr".to_owned(), 1, STRING.to_owned(), false),
                ("validity_duration".to_owned(), 3, INT64.to_owned(), false),
                (
                    "metadata".to_owned(),
                    4,
                    "google.protobuf.Struct".to_owned(),
                    false
                ),
            ]
        );
        assert_eq!(
            fields("IstioCertificateResponse"),
            [("cert_chain".to_owned(), 1, STRING.to_owned(), true)]
        );
        let file = protox_parse::parse("ca.proto", CA_PROTO).unwrap();
        let service = &file.service[0];
        assert_eq!(
            format!(
                "/{}.{}/{}",
                file.package(),
                service.name(),
                service.method[0].name()
            ),
            CREATE_CERTIFICATE
        );
        // The wire form uses those numbers: field 1 (csr, length-delimited) then 3.
        let bytes = IstioCertificateRequest {
            csr: "x".into(),
            validity_duration: 60,
            metadata: None,
        }
        .encode_to_vec();
        assert_eq!(bytes, [0x0a, 1, b'x', 0x18, 60]);
        // metadata (4, length-delimited): Struct.fields (1) holds one map entry, key
        // (1) "ImpersonatedIdentity", value (2) a Value whose string_value is 3.
        let id = "spiffe://td/ns/n/sa/s";
        let bytes = IstioCertificateRequest {
            metadata: Some(impersonating(id)),
            ..Default::default()
        }
        .encode_to_vec();
        let value = [&[0x1a, id.len() as u8][..], id.as_bytes()].concat();
        let entry = [
            &[0x0a, 20][..],
            b"ImpersonatedIdentity",
            &[0x12, value.len() as u8],
            &value,
        ]
        .concat();
        let fields = [&[0x0a, entry.len() as u8][..], &entry].concat();
        let expected = [&[0x22, fields.len() as u8][..], &fields].concat();
        assert_eq!(bytes, expected);
    }
}
