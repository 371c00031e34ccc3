//! Certificates for TLS tests, made at test time with the `openssl` CLI: CAs, and
//! certificates they sign for servers and clients (DNS `server.test` and Istio SPIFFE
//! identities).

use std::process::Command;

use super::TempDir;

/// The SPIFFE identity of [`Pki::server`]'s certificates.
pub const SERVER_ID: &str = "spiffe://cluster.local/ns/default/sa/server";

/// `openssl req` arguments for a new P-256 key, not encrypted.
const NEW_KEY: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:P-256",
    "-nodes",
];

/// A scratch folder of CAs and the certificates they sign, each as `NAME.pem` and
/// `NAME.key`, made with the `openssl` CLI.
pub struct Pki {
    pub dir: TempDir,
}

impl Pki {
    /// A fresh folder `tag` with the CA `ca`.
    pub fn new(tag: &str) -> Pki {
        let pki = Pki {
            dir: TempDir::new(tag),
        };
        pki.ca("ca");
        pki
    }

    /// Another self-signed CA, `name`.
    pub fn ca(&self, name: &str) {
        let (key, pem, subject) = (
            format!("{name}.key"),
            format!("{name}.pem"),
            format!("/CN=shunt test {name}"),
        );
        let args = [
            &["req", "-x509"][..],
            &NEW_KEY,
            &[
                "-keyout",
                &key,
                "-out",
                &pem,
                "-days",
                "2",
                "-subj",
                &subject,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        ];
        self.openssl(&args.concat());
    }

    pub fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir.0)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.0.join(file)).unwrap()
    }

    /// The path of `file` in the folder, as config and command lines name it.
    pub fn file(&self, file: &str) -> String {
        self.dir.0.join(file).display().to_string()
    }

    /// A certificate for `server.test` and [`SERVER_ID`] named `cn`, signed by the CA:
    /// (chain, key).
    pub fn server(&self, cn: &str) -> (String, String) {
        self.issue(cn, "ca", &format!("DNS:server.test,URI:{SERVER_ID}"))
    }

    /// A certificate named `cn` with the subjectAltName `sans` (none when empty), signed
    /// by the CA `ca`, good for server and client auth: (chain, key).
    pub fn issue(&self, cn: &str, ca: &str, sans: &str) -> (String, String) {
        let (key, csr, pem, ext) = (
            format!("{cn}.key"),
            format!("{cn}.csr"),
            format!("{cn}.pem"),
            format!("{cn}.ext"),
        );
        std::fs::write(
            self.dir.0.join(&ext),
            format!(
                "{}extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n",
                // No SAN at all: the subject is the only identity.
                if sans.is_empty() {
                    String::new()
                } else {
                    format!("subjectAltName={sans}\n")
                }
            ),
        )
        .unwrap();
        let subject = format!("/CN={cn}");
        let args = [
            &["req"][..],
            &NEW_KEY,
            &["-keyout", &key, "-out", &csr, "-subj", &subject],
        ];
        self.openssl(&args.concat());
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ]);
        (self.read(&pem), self.read(&key))
    }

    /// Lets the proxy, which drops to uid 1337, read the folder (test keys, thrown away
    /// after the test).
    pub fn open_to_the_proxy(&self) {
        use std::os::unix::fs::PermissionsExt;
        let dir = &self.dir.0;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
    }
}

/// The first certificate of a PEM chain, DER.
pub fn leaf(chain_pem: &str) -> Vec<u8> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .next()
        .expect("a certificate")
        .unwrap()
        .to_vec()
}

/// A certificate's URI SANs (its SPIFFE identity).
pub fn uris(der: &[u8]) -> Vec<String> {
    use x509_parser::prelude::{FromDer, GeneralName, ParsedExtension, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).unwrap();
    let mut uris = Vec::new();
    for ext in cert.extensions() {
        if let ParsedExtension::SubjectAlternativeName(san) = ext.parsed_extension() {
            for name in &san.general_names {
                if let GeneralName::URI(uri) = name {
                    uris.push(uri.to_string());
                }
            }
        }
    }
    uris
}
