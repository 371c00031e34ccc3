//! Certificates for tests, made by the `openssl` CLI at test time: a CA, a server
//! certificate with DNS, SPIFFE URI and IP SANs, a client certificate, and a second CA
//! nobody trusts. For this crate's tests and, with the `testing` feature, the tests of
//! the crates above.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Certificates in a scratch folder, removed when dropped.
pub struct Pki {
    pub dir: PathBuf,
}

const SERVER_SANS: &str =
    "DNS:server.test,URI:spiffe://cluster.local/ns/default/sa/server,IP:127.0.0.1";
const CLIENT_SANS: &str = "URI:spiffe://cluster.local/ns/default/sa/client";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

impl Pki {
    pub fn new() -> Pki {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "shunt-tls-unit-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        for ca in ["ca", "other-ca"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.pem"),
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN={ca}"),
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                ],
            );
        }
        for (name, ca, sans) in [
            ("server", "ca", SERVER_SANS),
            ("client", "ca", CLIENT_SANS),
            ("stranger", "other-ca", CLIENT_SANS),
        ] {
            openssl(
                &dir,
                &[
                    "req",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.csr"),
                    "-subj",
                    &format!("/CN={name}"),
                ],
            );
            std::fs::write(
                dir.join(format!("{name}.ext")),
                format!(
                    "subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
                ),
            )
            .unwrap();
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{name}.csr"),
                    "-CA",
                    &format!("{ca}.pem"),
                    "-CAkey",
                    &format!("{ca}.key"),
                    "-CAcreateserial",
                    "-out",
                    &format!("{name}.pem"),
                    "-days",
                    "2",
                    "-extfile",
                    &format!("{name}.ext"),
                ],
            );
        }
        Pki { dir }
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    pub fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.join(file)).unwrap()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
