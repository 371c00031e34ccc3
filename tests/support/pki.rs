//! Certificates for TLS tests, made at test time with the `openssl` CLI: a CA and
//! server certificates it signs (DNS `server.test` and an Istio SPIFFE identity).

use std::process::Command;

use super::xds::TempDir;

/// A CA and a server certificate made with the `openssl` CLI.
pub struct Pki {
    pub dir: TempDir,
}

impl Pki {
    pub fn new(tag: &str) -> Pki {
        let dir = TempDir::new(tag);
        let pki = Pki { dir };
        pki.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=shunt test CA",
        ]);
        pki
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

    /// A certificate for `server.test` (and an Istio SPIFFE identity) named `cn`,
    /// signed by the CA: (chain, key).
    pub fn server(&self, cn: &str) -> (String, String) {
        let ext = format!("{cn}.ext");
        std::fs::write(
            self.dir.0.join(&ext),
            "subjectAltName=DNS:server.test,URI:spiffe://cluster.local/ns/default/sa/server\n",
        )
        .unwrap();
        let (key, csr, pem) = (
            format!("{cn}.key"),
            format!("{cn}.csr"),
            format!("{cn}.pem"),
        );
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "1",
            "-extfile",
            &ext,
        ]);
        (self.read(&pem), self.read(&key))
    }
}
