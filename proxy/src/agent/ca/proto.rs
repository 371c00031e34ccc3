//! Istio's CA API (`istio.v1.auth`, istio/api `security/v1alpha1/ca.proto`): two small
//! messages written out by hand rather than generated, with a test that holds them to
//! the `.proto` (tests/fixtures/istio/protos/ca.proto); and the one call, unary gRPC.

/// The full gRPC method path pilot-agent calls.
pub const CREATE_CERTIFICATE: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateRequest {
    /// The PEM-encoded CSR.
    #[prost(string, tag = "1")]
    pub csr: String,
    /// Optional: the identity the CA should sign for (impersonation).
    #[prost(string, tag = "2")]
    pub subject_id: String,
    /// Requested lifetime in seconds; 0 leaves it to the CA.
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
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

    const CA_PROTO: &str = include_str!("../../../../tests/fixtures/istio/protos/ca.proto");

    /// Each field of `message` in ca.proto as (name, number, type, repeated).
    fn fields(message: &str) -> Vec<(String, i32, i32, bool)> {
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
                    f.r#type.unwrap_or_default(),
                    f.label == Some(3), // LABEL_REPEATED
                )
            })
            .collect()
    }

    // descriptor.proto's FieldDescriptorProto.Type values.
    const INT64: i32 = 3;
    const STRING: i32 = 9;

    #[test]
    fn the_messages_match_ca_proto() {
        assert_eq!(
            fields("IstioCertificateRequest"),
            [
                ("csr".to_owned(), 1, STRING, false),
                ("subject_id".to_owned(), 2, STRING, false),
                ("validity_duration".to_owned(), 3, INT64, false),
            ]
        );
        assert_eq!(
            fields("IstioCertificateResponse"),
            [("cert_chain".to_owned(), 1, STRING, true)]
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
            subject_id: String::new(),
            validity_duration: 60,
        }
        .encode_to_vec();
        assert_eq!(bytes, [0x0a, 1, b'x', 0x18, 60]);
    }
}
