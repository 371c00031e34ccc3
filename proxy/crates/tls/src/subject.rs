//! A certificate's subject as Envoy reports it (`subjectPeerCertificate`, what RBAC's
//! `authenticated.principal_name` falls back to when a peer certificate has no SAN):
//! OpenSSL's `X509_NAME_print_ex` with `XN_FLAG_RFC2253`, i.e. RFC 2253 text with the
//! last RDN first, `,` between RDNs, `+` inside a multi-valued one, and OpenSSL's short
//! attribute names.

use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::x509::AttributeTypeAndValue;

/// The subject of the DER certificate `der`; `None` when it does not parse.
pub fn of_certificate(der: &[u8]) -> Option<String> {
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let rdns: Vec<String> = cert
        .subject()
        .iter()
        .map(|rdn| rdn.iter().map(attribute).collect::<Vec<_>>().join("+"))
        .collect();
    Some(rdns.into_iter().rev().collect::<Vec<_>>().join(","))
}

fn attribute(attr: &AttributeTypeAndValue) -> String {
    let oid = attr.attr_type().to_id_string();
    let name = match oid.as_str() {
        "2.5.4.3" => "CN",
        "2.5.4.6" => "C",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.9" => "street",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.5" => "serialNumber",
        "0.9.2342.19200300.100.1.25" => "DC",
        "0.9.2342.19200300.100.1.1" => "UID",
        "1.2.840.113549.1.9.1" => "emailAddress",
        _ => "",
    };
    match (name, attr.as_str()) {
        ("", _) | (_, Err(_)) => {
            // RFC 2253: an unknown type, or a value that is not a string, as `OID=#hex`
            // of its DER encoding.
            let raw = attr.attr_value();
            let mut hex = format!("#{:02x}", raw.header.tag().0 as u8);
            let body = raw.data;
            hex.push_str(&der_length(body.len()));
            for b in body {
                hex.push_str(&format!("{b:02x}"));
            }
            let name = if name.is_empty() { &oid } else { name };
            format!("{name}={hex}")
        }
        (name, Ok(value)) => format!("{name}={}", escape(value)),
    }
}

/// A DER length in hex.
fn der_length(len: usize) -> String {
    if len < 0x80 {
        return format!("{len:02x}");
    }
    let bytes: Vec<u8> = len
        .to_be_bytes()
        .into_iter()
        .skip_while(|b| *b == 0)
        .collect();
    let mut out = format!("{:02x}", 0x80 | bytes.len() as u8);
    for b in bytes {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// RFC 2253's escaping of an attribute value.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let last = value.chars().count().saturating_sub(1);
    for (i, c) in value.chars().enumerate() {
        let special = matches!(c, ',' | '+' | '"' | '\\' | '<' | '>' | ';')
            || (i == 0 && (c == '#' || c == ' '))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certificate(subject: &[(rcgen::DnType, &str)]) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        for (kind, value) in subject {
            params.distinguished_name.push(kind.clone(), *value);
        }
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn the_last_rdn_comes_first_as_openssl_prints_rfc2253() {
        let der = certificate(&[
            (rcgen::DnType::CountryName, "US"),
            (rcgen::DnType::OrganizationName, "Acme, Inc"),
            (rcgen::DnType::CommonName, "sleep"),
        ]);
        assert_eq!(
            of_certificate(&der).as_deref(),
            Some("CN=sleep,O=Acme\\, Inc,C=US")
        );
    }

    #[test]
    fn a_lone_common_name() {
        let der = certificate(&[(rcgen::DnType::CommonName, "nosan")]);
        assert_eq!(of_certificate(&der).as_deref(), Some("CN=nosan"));
        assert_eq!(of_certificate(b"not a certificate"), None);
    }
}
