//! Small conversions from Envoy's field types, each naming the path it failed at.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{
    Address, CidrRange, SocketAddress, address, socket_address::PortSpecifier,
    socket_address::Protocol,
};
use envoy_types::pb::google::protobuf::{Any, Duration as PbDuration};
use prost::{Message, Name};

use super::diagnostic::{Diagnostics, JsonPath};
use ipnet::IpNet;

/// An IP prefix of `len` bits; host bits are cleared, as Envoy does. `None` past the
/// family's length.
pub fn prefix(addr: IpAddr, len: u8) -> Option<IpNet> {
    IpNet::new(addr, len).ok().map(|net| net.trunc())
}

/// A `google.protobuf.Duration`; negative is an error.
pub fn duration(d: &PbDuration, path: &JsonPath, problems: &mut Diagnostics) -> Option<Duration> {
    if d.seconds < 0 || d.nanos < 0 {
        problems.error(path, "a duration cannot be negative");
        return None;
    }
    Some(Duration::new(d.seconds as u64, d.nanos as u32))
}

/// An optional duration with a default; 0s stays 0.
pub fn duration_or(
    d: Option<&PbDuration>,
    default: Duration,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Duration {
    d.and_then(|d| duration(d, path, problems))
        .unwrap_or(default)
}

/// The socket address of an `Address`, which must be TCP with a port number.
pub fn socket_address<'a>(
    address: Option<&'a Address>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<&'a SocketAddress> {
    match address.and_then(|a| a.address.as_ref()) {
        Some(address::Address::SocketAddress(socket)) => {
            if socket.protocol == Protocol::Udp as i32 {
                problems.error(
                    path.field("socket_address").field("protocol"),
                    "UDP is not implemented yet",
                );
                return None;
            }
            Some(socket)
        }
        Some(address::Address::Pipe(_)) => {
            problems.error(
                path.field("pipe"),
                "Unix domain socket addresses are not implemented yet",
            );
            None
        }
        Some(address::Address::EnvoyInternalAddress(_)) => {
            problems.error(
                path.field("envoy_internal_address"),
                "internal addresses are not implemented yet",
            );
            None
        }
        None => {
            problems.error(path, "an address is required");
            None
        }
    }
}

/// The port of a socket address; named ports are not supported.
pub fn port(socket: &SocketAddress, path: &JsonPath, problems: &mut Diagnostics) -> Option<u16> {
    match &socket.port_specifier {
        Some(PortSpecifier::PortValue(port)) => match u16::try_from(*port) {
            Ok(port) => Some(port),
            Err(_) => {
                problems.error(
                    path.field("port_value"),
                    format!("{port} is not a TCP port"),
                );
                None
            }
        },
        Some(PortSpecifier::NamedPort(name)) => {
            problems.error(
                path.field("named_port"),
                format!("named port {name:?} is not supported; give port_value"),
            );
            None
        }
        None => Some(0),
    }
}

/// An `Address` that must be an IP literal and port.
pub fn ip_socket_addr(
    address: Option<&Address>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<SocketAddr> {
    let socket = socket_address(address, path, problems)?;
    let path = path.field("socket_address");
    let port = port(socket, &path, problems)?;
    match socket.address.parse::<IpAddr>() {
        Ok(ip) => Some(SocketAddr::new(ip, port)),
        Err(_) => {
            problems.error(
                path.field("address"),
                format!("{:?} is not an IP address", socket.address),
            );
            None
        }
    }
}

pub fn cidr(range: &CidrRange, path: &JsonPath, problems: &mut Diagnostics) -> Option<IpNet> {
    let Ok(ip) = range.address_prefix.parse::<IpAddr>() else {
        problems.error(
            path.field("address_prefix"),
            format!("{:?} is not an IP address", range.address_prefix),
        );
        return None;
    };
    let len = range.prefix_len.map_or(0, |l| l.value);
    let cidr = u8::try_from(len).ok().and_then(|len| prefix(ip, len));
    if cidr.is_none() {
        problems.error(
            path.field("prefix_len"),
            format!("{len} is too long for {ip}"),
        );
    }
    cidr
}

/// The type name an `Any` carries (after the last `/` of its type URL).
pub fn type_name(any: &Any) -> &str {
    any.type_url.rsplit('/').next().unwrap_or(&any.type_url)
}

/// Decodes an `Any` known to hold `M`.
pub fn decode<M: Message + Name + Default>(
    any: &Any,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<M> {
    match M::decode(any.value.as_slice()) {
        Ok(message) => Some(message),
        Err(err) => {
            problems.error(path, format!("cannot decode {}: {err}", M::full_name()));
            None
        }
    }
}

/// Wasm filters, HTTP and network: shunt runs no Wasm, so a listener that needs one is
/// refused (Istio's own filters have native equivalents).
pub const WASM_FILTERS: [&str; 2] = [
    "envoy.extensions.filters.http.wasm.v3.Wasm",
    "envoy.extensions.filters.network.wasm.v3.Wasm",
];

/// The refusal of filter `name` of config type `kind`, if it is a Wasm filter.
pub fn wasm_unsupported(kind: &str, name: &str) -> Option<String> {
    WASM_FILTERS
        .contains(&kind)
        .then(|| format!("filter {name:?} ({kind}) runs Wasm, and Wasm is not supported by shunt"))
}
