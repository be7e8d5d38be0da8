//! Test hosts as network namespaces: two namespaces joined by a veth pair, each end with a
//! documentation address, removed (with the veth) when dropped, passing or not; and the
//! faults a test injects on that link: `tc netem` (loss, delay, reordering, duplication)
//! on both ends, and the link going down and up. [`Lan`]: any number of hosts on one
//! switch (a bridge in a namespace of its own), each host's link able to go down alone.

use std::process::{Command, Stdio};

/// Runs `program ARGS`; the error names the command and its stderr.
fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `ip ARGS`.
pub fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

/// Why this machine cannot create test hosts, if it cannot: not root, or no `ip netns`.
pub fn cannot_run() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    ip(&["netns", "list"])
        .err()
        .map(|e| format!("`ip netns` is unavailable ({e}); install iproute2"))
}

/// Two namespaces `a` and `b` joined by a veth pair (`veth_a` in `a`, `veth_b` in `b`).
#[derive(Debug)]
pub struct Hosts {
    pub a: String,
    pub b: String,
    pub veth_a: String,
    pub veth_b: String,
}

impl Hosts {
    /// Creates the namespaces, named after `tag` and this process, with `addr_a` and
    /// `addr_b` (each with its /24) on the two ends, every link up.
    pub fn create(tag: &str, addr_a: &str, addr_b: &str) -> Result<Hosts, String> {
        let pid = std::process::id();
        // Interface names are at most 15 bytes: a tag of up to 4 bytes, "a", a pid of at
        // most 7 digits.
        let tag: String = tag.chars().take(4).collect();
        let hosts = Hosts {
            a: format!("kvf-{tag}-a-{pid}"),
            b: format!("kvf-{tag}-b-{pid}"),
            veth_a: format!("{tag}a{pid}"),
            veth_b: format!("{tag}b{pid}"),
        };
        // From here on, dropping `hosts` removes whatever was made.
        let (a, b) = (hosts.a.as_str(), hosts.b.as_str());
        let (va, vb) = (hosts.veth_a.as_str(), hosts.veth_b.as_str());
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&["link", "add", va, "type", "veth", "peer", "name", vb])?;
        ip(&["link", "set", va, "netns", a])?;
        ip(&["link", "set", vb, "netns", b])?;
        ip(&["-n", a, "addr", "add", &format!("{addr_a}/24"), "dev", va])?;
        ip(&["-n", b, "addr", "add", &format!("{addr_b}/24"), "dev", vb])?;
        for (ns, dev) in [(a, va), (b, vb)] {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(hosts)
    }

    /// The command prefix that runs a program in namespace `ns`.
    pub fn exec(ns: &str) -> Vec<String> {
        ["ip", "netns", "exec", ns].map(String::from).to_vec()
    }

    fn ends(&self) -> [(&str, &str); 2] {
        [
            (self.a.as_str(), self.veth_a.as_str()),
            (self.b.as_str(), self.veth_b.as_str()),
        ]
    }

    /// Puts `tc netem ARGS` on both ends of the link (each end's outgoing packets), replacing
    /// what was there.
    pub fn netem(&self, args: &[&str]) -> Result<(), String> {
        for (ns, dev) in self.ends() {
            let mut a = vec!["-n", ns, "qdisc", "replace", "dev", dev, "root", "netem"];
            a.extend_from_slice(args);
            run("tc", &a)?;
        }
        Ok(())
    }

    /// Takes netem off both ends (a no-op where there is none).
    pub fn clear_netem(&self) -> Result<(), String> {
        for (ns, dev) in self.ends() {
            // "Cannot delete qdisc with handle of zero": nothing was there.
            if let Err(e) = run("tc", &["-n", ns, "qdisc", "del", "dev", dev, "root"])
                && !e.contains("handle of zero")
                && !e.contains("No such file")
            {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Why netem cannot be used here (no `tc`, or a kernel without `sch_netem`), if it
    /// cannot: tried on the link, then taken off again.
    pub fn netem_unavailable(&self) -> Option<String> {
        let tried = self.netem(&["delay", "1ms"]);
        let cleared = self.clear_netem();
        tried.and(cleared).err()
    }

    /// Sets the link up or down, at both ends.
    pub fn link(&self, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        for (ns, dev) in self.ends() {
            ip(&["-n", ns, "link", "set", dev, state])?;
        }
        Ok(())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            // Removing a namespace removes the veth end in it, and with it the pair.
            if let Err(e) = ip(&["netns", "del", ns])
                && !e.contains("No such file")
            {
                eprintln!("removing namespace {ns}: {e}");
            }
        }
    }
}

/// Hosts on one switch: each a namespace with a veth to a bridge in a hub namespace, all
/// removed when dropped, passing or not.
#[derive(Debug)]
pub struct Lan {
    /// The host namespaces, in the order of their addresses.
    pub hosts: Vec<String>,
    hub: String,
    /// The hub's end of each host's link.
    ports: Vec<String>,
}

impl Lan {
    /// One namespace per address of `addrs` (each with its /24), named after `tag` and this
    /// process, on one bridge; every link up.
    pub fn create(tag: &str, addrs: &[&str]) -> Result<Lan, String> {
        assert!(addrs.len() <= 10, "at most 10 hosts");
        let pid = std::process::id();
        // Interface names are at most 15 bytes: a tag of up to 4 bytes, the host's digit,
        // "h" on the hub's end, a pid of at most 7 digits.
        let tag: String = tag.chars().take(4).collect();
        let mut lan = Lan {
            hosts: Vec::new(),
            hub: format!("kvf-{tag}-hub-{pid}"),
            ports: Vec::new(),
        };
        // From here on, dropping `lan` removes whatever was made.
        ip(&["netns", "add", &lan.hub])?;
        ip(&["-n", &lan.hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &lan.hub, "link", "set", "br0", "up"])?;
        for (i, addr) in addrs.iter().enumerate() {
            let host = format!("kvf-{tag}-{i}-{pid}");
            let (dev, port) = (format!("{tag}{i}{pid}"), format!("{tag}{i}h{pid}"));
            ip(&["netns", "add", &host])?;
            lan.hosts.push(host.clone());
            ip(&["link", "add", &dev, "type", "veth", "peer", "name", &port])?;
            ip(&["link", "set", &port, "netns", &lan.hub])?;
            lan.ports.push(port.clone());
            ip(&["link", "set", &dev, "netns", &host])?;
            ip(&[
                "-n",
                &host,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                &dev,
            ])?;
            ip(&["-n", &host, "link", "set", "lo", "up"])?;
            ip(&["-n", &host, "link", "set", &dev, "up"])?;
            ip(&["-n", &lan.hub, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &lan.hub, "link", "set", &port, "up"])?;
        }
        Ok(lan)
    }

    /// Cuts host `i` off the switch, or joins it again.
    pub fn link(&self, i: usize, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.hub, "link", "set", &self.ports[i], state])
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain([&self.hub]) {
            if let Err(e) = ip(&["netns", "del", ns])
                && !e.contains("No such file")
            {
                eprintln!("removing namespace {ns}: {e}");
            }
        }
    }
}
