//! Addresses: which address of this host a rank advertises to others, and
//! which local address reaches another host. The TCP transport binds its
//! links with them; the C API puts the address of its rendezvous into a
//! unique id with them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, ToSocketAddrs, UdpSocket};

use ccl_core::{Error, Result};

/// The local address the OS would use to reach `host:port` (a UDP socket is
/// connected, which sends nothing). `None` if `host` does not resolve or no
/// route leads there. `host` may be a name or an address (IPv6 with or without brackets).
pub fn route_to(host: &str, port: u16) -> Option<IpAddr> {
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    // Connecting a UDP socket to port 0 is refused; any port finds the same route.
    let port = if port == 0 { 9 } else { port };
    let targets = (host, port).to_socket_addrs().ok()?;
    for target in targets {
        let unspecified: SocketAddr = match target {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let Ok(socket) = UdpSocket::bind(unspecified) else {
            continue;
        };
        if socket.connect(target).is_err() {
            continue;
        }
        match socket.local_addr() {
            Ok(local) if !local.ip().is_unspecified() => return Some(local.ip()),
            _ => continue,
        }
    }
    None
}

/// The address of network interface `name`: IPv4 if it has one, else a global
/// IPv6 address, else a link-local one (with its scope).
pub fn interface_address(name: &str) -> Result<SocketAddr> {
    let addrs = nix::ifaddrs::getifaddrs()
        .map_err(|e| Error::Config(format!("listing network interfaces for '{name}': {e}")))?;
    let mut found = false;
    let (mut v4, mut v6, mut v6_local) = (None, None, None);
    for ifa in addrs.filter(|i| i.interface_name == name) {
        found = true;
        let Some(a) = ifa.address else { continue };
        if let Some(sin) = a.as_sockaddr_in() {
            v4 = v4.or(Some(SocketAddr::new(IpAddr::V4(sin.ip()), 0)));
        } else if let Some(sin6) = a.as_sockaddr_in6() {
            let ip = sin6.ip();
            if ip.segments()[0] & 0xffc0 == 0xfe80 {
                v6_local = v6_local.or(Some(SocketAddr::V6(SocketAddrV6::new(
                    ip,
                    0,
                    0,
                    sin6.scope_id(),
                ))));
            } else {
                v6 = v6.or(Some(SocketAddr::new(IpAddr::V6(ip), 0)));
            }
        }
    }
    if !found {
        return Err(Error::Config(format!(
            "network interface '{name}' (CCL_SOCKET_IFNAME) does not exist"
        )));
    }
    v4.or(v6)
        .or(v6_local)
        .ok_or_else(|| Error::Config(format!("network interface '{name}' has no IP address")))
}

/// Whether `ip` is a loopback address or an address of one of this host's
/// interfaces (of this network namespace), so that a socket to it stays on
/// this host.
pub fn is_local_address(ip: IpAddr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return false;
    };
    addrs.filter_map(|i| i.address).any(|a| {
        a.as_sockaddr_in().map(|s| IpAddr::V4(s.ip())) == Some(ip)
            || a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())) == Some(ip)
    })
}

/// The address this host advertises to others: the interface `ifname`'s
/// (`CCL_SOCKET_IFNAME`), else the first IPv4 address of an interface that
/// is up and not loopback, else `127.0.0.1`.
pub fn advertised_ip(ifname: Option<&str>) -> Result<IpAddr> {
    if let Some(name) = ifname {
        return interface_address(name).map(|a| a.ip());
    }
    let addrs = nix::ifaddrs::getifaddrs()
        .map_err(|e| Error::Config(format!("listing network interfaces: {e}")))?;
    let up = nix::net::if_::InterfaceFlags::IFF_UP;
    let loopback = nix::net::if_::InterfaceFlags::IFF_LOOPBACK;
    Ok(addrs
        .filter(|i| i.flags.contains(up) && !i.flags.contains(loopback))
        .find_map(|i| i.address?.as_sockaddr_in().map(|a| IpAddr::V4(a.ip())))
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_lookup() {
        let lo = interface_address("lo").unwrap();
        assert!(lo.ip().is_loopback(), "{lo}");
        assert!(matches!(
            interface_address("no-such-if0"),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn local_addresses_are_told_from_others() {
        assert!(is_local_address(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        assert!(is_local_address(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))));
        let advertised = advertised_ip(None).unwrap();
        assert!(is_local_address(advertised), "{advertised}");
        // TEST-NET-2: reserved for documentation, on no interface.
        assert!(!is_local_address(IpAddr::V4(Ipv4Addr::new(
            198, 51, 100, 1
        ))));
    }

    #[test]
    fn the_named_interface_is_advertised() {
        assert!(advertised_ip(Some("lo")).unwrap().is_loopback());
        assert!(advertised_ip(Some("no-such-if0")).is_err());
        assert!(advertised_ip(None).is_ok());
    }

    #[test]
    fn route_to_loopback() {
        assert_eq!(
            route_to("127.0.0.1", 29500),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(
            route_to("127.0.0.1", 0),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert!(route_to("localhost", 29500).is_some_and(|ip| ip.is_loopback()));
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            assert_eq!(route_to("[::1]", 1), Some(IpAddr::V6(Ipv6Addr::LOCALHOST)));
            assert_eq!(route_to("::1", 1), Some(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        }
    }
}
