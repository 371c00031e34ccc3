//! Envoy's compression libraries (`envoy.compression.{gzip,brotli,zstd}.compressor` and
//! `.decompressor`), which the compressor and decompressor HTTP filters name in their
//! `compressor_library` / `decompressor_library`: the library compiled from its config,
//! and the streaming [`BodyTransform`] it makes for one body.
//!
//! A compressor flushes at every frame (Envoy's `State::Flush`, a sync flush), so a
//! streamed response is never held back, and finishes its format's trailer at the end.
//! Gzip's `window_bits` and `memory_level` and Brotli's `encoder_mode` are tuning
//! knobs of Envoy's zlib/brotli; the output of any setting decompresses to the same
//! bytes, so shunt uses its libraries' defaults for them.

use std::io::Write;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig;
use envoy_types::pb::envoy::extensions::compression::brotli::compressor::v3::Brotli;
use envoy_types::pb::envoy::extensions::compression::gzip::compressor::v3::Gzip;
use envoy_types::pb::envoy::extensions::compression::zstd::compressor::v3::Zstd;
use envoy_types::pb::envoy::extensions::compression::{
    brotli::decompressor::v3::Brotli as BrotliDecompressor,
    gzip::decompressor::v3::Gzip as GzipDecompressor,
    zstd::decompressor::v3::Zstd as ZstdDecompressor,
};

use shunt_config::{Diagnostics, JsonPath, convert};

const GZIP: &str = "envoy.extensions.compression.gzip.compressor.v3.Gzip";
const BROTLI: &str = "envoy.extensions.compression.brotli.compressor.v3.Brotli";
const ZSTD: &str = "envoy.extensions.compression.zstd.compressor.v3.Zstd";
const GZIP_DECOMPRESSOR: &str = "envoy.extensions.compression.gzip.decompressor.v3.Gzip";
const BROTLI_DECOMPRESSOR: &str = "envoy.extensions.compression.brotli.decompressor.v3.Brotli";
const ZSTD_DECOMPRESSOR: &str = "envoy.extensions.compression.zstd.decompressor.v3.Zstd";

/// The compressor library types shunt implements (for config validation's list).
pub const COMPRESSOR_TYPES: [&str; 3] = [GZIP, BROTLI, ZSTD];
pub const DECOMPRESSOR_TYPES: [&str; 3] =
    [GZIP_DECOMPRESSOR, BROTLI_DECOMPRESSOR, ZSTD_DECOMPRESSOR];

/// A streaming change of a body: each data frame in, its replacement out. `end_stream`
/// is the last call (the body's end, or just before its trailers), when the transform
/// flushes what it still holds; it may come with no data.
pub trait BodyTransform: Send + std::fmt::Debug {
    fn transform(&mut self, data: &[u8], end_stream: bool) -> std::io::Result<Bytes>;
}

/// A compression format, by the `content-encoding` token it goes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Gzip,
    Brotli,
    Zstd,
}

impl Encoding {
    /// The `content-encoding` / `accept-encoding` token.
    pub fn token(self) -> &'static str {
        match self {
            Encoding::Gzip => "gzip",
            Encoding::Brotli => "br",
            Encoding::Zstd => "zstd",
        }
    }

    /// The library's part of the filter's stat names (`gzip.`, `brotli.`, `zstd.`).
    pub fn stats_prefix(self) -> &'static str {
        match self {
            Encoding::Gzip => "gzip.",
            Encoding::Brotli => "brotli.",
            Encoding::Zstd => "zstd.",
        }
    }
}

/// A compressor library as configured.
#[derive(Debug, Clone, Copy)]
pub struct CompressorLibrary {
    pub encoding: Encoding,
    /// zlib's level (gzip), Brotli's quality, zstd's level.
    level: i32,
    /// Brotli's `window_bits` (lgwin).
    window_bits: u32,
    /// zstd's `enable_checksum`.
    checksum: bool,
}

impl CompressorLibrary {
    /// Compiles `compressor_library` at `path`.
    pub fn compile(
        library: Option<&TypedExtensionConfig>,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<CompressorLibrary> {
        let Some(any) = library.and_then(|l| l.typed_config.as_ref()) else {
            problems.error(path, "a compressor library is required");
            return None;
        };
        let path = path.field("typed_config");
        match convert::type_name(any) {
            GZIP => {
                let gzip: Gzip = convert::decode(any, &path, problems)?;
                // DEFAULT_COMPRESSION (0) is zlib's default, level 6.
                let level = match gzip.compression_level {
                    0 => 6,
                    level => level.clamp(1, 9),
                };
                Some(CompressorLibrary::new(Encoding::Gzip, level))
            }
            BROTLI => {
                let brotli: Brotli = convert::decode(any, &path, problems)?;
                let mut library = CompressorLibrary::new(
                    Encoding::Brotli,
                    brotli.quality.map_or(3, |q| q.value.min(11) as i32),
                );
                library.window_bits = brotli.window_bits.map_or(18, |w| w.value.clamp(10, 24));
                Some(library)
            }
            ZSTD => {
                let zstd: Zstd = convert::decode(any, &path, problems)?;
                if zstd.dictionary.is_some() {
                    problems.error(
                        path.field("dictionary"),
                        "zstd dictionaries are not supported by shunt",
                    );
                    return None;
                }
                let mut library = CompressorLibrary::new(
                    Encoding::Zstd,
                    zstd.compression_level.map_or(3, |l| l.value.min(22) as i32),
                );
                library.checksum = zstd.enable_checksum;
                Some(library)
            }
            other => {
                problems.error(
                    path,
                    format!("compressor library {other} is not supported by shunt (it has gzip, brotli and zstd)"),
                );
                None
            }
        }
    }

    fn new(encoding: Encoding, level: i32) -> Self {
        CompressorLibrary {
            encoding,
            level,
            window_bits: 18,
            checksum: false,
        }
    }

    /// A compressor for one body.
    pub fn compressor(&self) -> Box<dyn BodyTransform> {
        let compressor = match self.encoding {
            Encoding::Gzip => Compressor::Gzip(flate2::write::GzEncoder::new(
                Vec::new(),
                flate2::Compression::new(self.level as u32),
            )),
            Encoding::Brotli => Compressor::Brotli(Some(Box::new(brotli::CompressorWriter::new(
                Vec::new(),
                4096,
                self.level as u32,
                self.window_bits,
            )))),
            Encoding::Zstd => {
                // Only fails when zstd cannot allocate its context.
                let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), self.level)
                    .expect("a zstd compression context");
                let _ = encoder.include_checksum(self.checksum);
                Compressor::Zstd(encoder)
            }
        };
        Box::new(compressor)
    }
}

/// A decompressor library as configured.
#[derive(Debug, Clone, Copy)]
pub struct DecompressorLibrary {
    pub encoding: Encoding,
}

impl DecompressorLibrary {
    /// Compiles `decompressor_library` at `path`.
    pub fn compile(
        library: Option<&TypedExtensionConfig>,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<DecompressorLibrary> {
        let Some(any) = library.and_then(|l| l.typed_config.as_ref()) else {
            problems.error(path, "a decompressor library is required");
            return None;
        };
        let path = path.field("typed_config");
        let encoding = match convert::type_name(any) {
            GZIP_DECOMPRESSOR => {
                convert::decode::<GzipDecompressor>(any, &path, problems)?;
                Encoding::Gzip
            }
            BROTLI_DECOMPRESSOR => {
                convert::decode::<BrotliDecompressor>(any, &path, problems)?;
                Encoding::Brotli
            }
            ZSTD_DECOMPRESSOR => {
                let zstd: ZstdDecompressor = convert::decode(any, &path, problems)?;
                if !zstd.dictionaries.is_empty() {
                    problems.error(
                        path.field("dictionaries"),
                        "zstd dictionaries are not supported by shunt",
                    );
                    return None;
                }
                Encoding::Zstd
            }
            other => {
                problems.error(
                    path,
                    format!("decompressor library {other} is not supported by shunt (it has gzip, brotli and zstd)"),
                );
                return None;
            }
        };
        Some(DecompressorLibrary { encoding })
    }

    /// A decompressor for one body.
    pub fn decompressor(&self) -> Box<dyn BodyTransform> {
        let decompressor = match self.encoding {
            Encoding::Gzip => Decompressor::Gzip(flate2::write::GzDecoder::new(Vec::new())),
            Encoding::Brotli => {
                Decompressor::Brotli(Box::new(brotli::DecompressorWriter::new(Vec::new(), 4096)))
            }
            Encoding::Zstd => Decompressor::Zstd(
                zstd::stream::write::Decoder::new(Vec::new())
                    .expect("a zstd decompression context"),
            ),
        };
        Box::new(decompressor)
    }
}

/// One body being compressed: each frame written and flushed, the output taken.
enum Compressor {
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
    /// `None` once finished (Brotli finishes by consuming its writer).
    Brotli(Option<Box<brotli::CompressorWriter<Vec<u8>>>>),
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
}

impl std::fmt::Debug for Compressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compressor::Gzip(_) => "Compressor(gzip)",
            Compressor::Brotli(_) => "Compressor(br)",
            Compressor::Zstd(_) => "Compressor(zstd)",
        })
    }
}

impl BodyTransform for Compressor {
    fn transform(&mut self, data: &[u8], end_stream: bool) -> std::io::Result<Bytes> {
        let out = match self {
            Compressor::Gzip(gzip) => {
                gzip.write_all(data)?;
                if end_stream {
                    gzip.try_finish()?;
                } else {
                    gzip.flush()?;
                }
                std::mem::take(gzip.get_mut())
            }
            Compressor::Brotli(slot) => {
                let Some(brotli) = slot.as_mut() else {
                    return Ok(Bytes::new());
                };
                brotli.write_all(data)?;
                if end_stream {
                    slot.take().map(|b| b.into_inner()).unwrap_or_default()
                } else {
                    brotli.flush()?;
                    std::mem::take(brotli.get_mut())
                }
            }
            Compressor::Zstd(zstd) => {
                zstd.write_all(data)?;
                if end_stream {
                    zstd.do_finish()?;
                } else {
                    zstd.flush()?;
                }
                std::mem::take(zstd.get_mut())
            }
        };
        Ok(Bytes::from(out))
    }
}

/// One body being decompressed: each frame written, what came out taken.
enum Decompressor {
    Gzip(flate2::write::GzDecoder<Vec<u8>>),
    Brotli(Box<brotli::DecompressorWriter<Vec<u8>>>),
    Zstd(zstd::stream::write::Decoder<'static, Vec<u8>>),
}

impl std::fmt::Debug for Decompressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Decompressor::Gzip(_) => "Decompressor(gzip)",
            Decompressor::Brotli(_) => "Decompressor(br)",
            Decompressor::Zstd(_) => "Decompressor(zstd)",
        })
    }
}

impl BodyTransform for Decompressor {
    fn transform(&mut self, data: &[u8], end_stream: bool) -> std::io::Result<Bytes> {
        let out = match self {
            Decompressor::Gzip(gzip) => {
                gzip.write_all(data)?;
                if end_stream {
                    gzip.try_finish()?;
                } else {
                    gzip.flush()?;
                }
                std::mem::take(gzip.get_mut())
            }
            Decompressor::Brotli(brotli) => {
                brotli.write_all(data)?;
                brotli.flush()?;
                std::mem::take(brotli.get_mut())
            }
            Decompressor::Zstd(zstd) => {
                zstd.write_all(data)?;
                zstd.flush()?;
                std::mem::take(zstd.get_mut())
            }
        };
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(encoding: Encoding) {
        let library = CompressorLibrary::new(encoding, 3);
        let mut compressor = library.compressor();
        let mut decompressor = DecompressorLibrary { encoding }.decompressor();
        let text = b"the quick brown fox jumps over the lazy dog ".repeat(200);
        let mut compressed = Vec::new();
        for (i, chunk) in text.chunks(1000).enumerate() {
            let out = compressor.transform(chunk, false).unwrap();
            // A flush makes every frame's bytes decodable as they arrive.
            assert!(!out.is_empty(), "{encoding:?}: frame {i} was held back");
            compressed.extend_from_slice(&out);
        }
        compressed.extend_from_slice(&compressor.transform(b"", true).unwrap());
        assert!(
            compressed.len() < text.len() / 4,
            "{encoding:?} did not compress"
        );
        let mut plain = Vec::new();
        for chunk in compressed.chunks(7) {
            plain.extend_from_slice(&decompressor.transform(chunk, false).unwrap());
        }
        plain.extend_from_slice(&decompressor.transform(b"", true).unwrap());
        assert_eq!(plain, text, "{encoding:?}");
    }

    #[test]
    fn each_format_round_trips_frame_by_frame() {
        round_trip(Encoding::Gzip);
        round_trip(Encoding::Brotli);
        round_trip(Encoding::Zstd);
    }
}
