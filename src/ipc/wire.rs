//! What travels between an exporting and an importing process: the export
//! data, the protocol's words, and descriptors over Unix sockets.

use std::hash::{BuildHasher, Hasher};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::OnceLock;

use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::{Error, Result};

// ---- export data -------------------------------------------------------------

/// What another process needs to import one allocation
/// (`cudaMemPoolPtrExportData`). Plain bytes: send them any way you like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportData {
    /// The exporting pool (see [`pool_token`]).
    pub(super) token: u64,
    /// Tells this export from an earlier one at the same address.
    pub(super) serial: u64,
    pub(super) ptr: u64,
    pub(super) size: u64,
}

impl ExportData {
    /// The size of the export data in bytes, for any channel.
    pub const LEN: usize = 32;

    /// The export data as bytes, to send to the importing process.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        for (i, word) in [self.token, self.serial, self.ptr, self.size]
            .into_iter()
            .enumerate()
        {
            out[i * 8..][..8].copy_from_slice(&word.to_le_bytes());
        }
        out
    }

    /// Export data read back from [`ExportData::to_bytes`]'s bytes; an error
    /// unless `bytes` is exactly [`ExportData::LEN`] long and well formed.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != Self::LEN {
            return Err(Error::Ipc(format!(
                "export data has {} bytes, not {}",
                bytes.len(),
                Self::LEN
            )));
        }
        let words = words(bytes);
        Ok(Self {
            token: words[0],
            serial: words[1],
            ptr: words[2],
            size: words[3],
        })
    }

    /// The allocation's address in the exporting process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The allocation's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// A pool's name across processes: its id mixed with a number drawn once
/// per process, so that pool 1 of one process is not pool 1 of another.
pub(super) fn pool_token(pool_id: u64) -> u64 {
    static SALT: OnceLock<u64> = OnceLock::new();
    let salt = *SALT.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    });
    salt ^ pool_id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

// message is little-endian u64 words; an error reply adds its text.
pub(super) const HELLO: u64 = 1;
/// The protocol's version, in the hello: builds that speak another refuse
/// each other by name rather than misreading each other's messages.
/// Version 1 had no version word and no device UUID in the answer.
pub(super) const PROTOCOL: u64 = 2;
/// How long [`ImportedPool::from_shareable_handle`] waits for the exporter.
///
/// [`ImportedPool::from_shareable_handle`]: super::ImportedPool::from_shareable_handle
pub(super) const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
pub(super) const IMPORT: u64 = 2;
pub(super) const RELEASE: u64 = 3;
pub(super) const OK: u64 = 0;
pub(super) const STALE: u64 = 1;
pub(super) const FOREIGN: u64 = 2;
pub(super) const FAILED: u64 = 3;

// ---- descriptors over Unix sockets -----------------------------------------------

/// Sends `handle` over the Unix socket `socket` (`SCM_RIGHTS`), with one
/// byte of data. The receiver gets its own descriptor; drop yours after.
pub fn send_handle(socket: impl AsFd, handle: BorrowedFd<'_>) -> Result<()> {
    send(socket.as_fd(), b"h", Some(handle))
}

/// Receives a descriptor that [`send_handle`] sent.
pub fn recv_handle(socket: impl AsFd) -> Result<OwnedFd> {
    let mut byte = [0u8; 1];
    match recv(socket.as_fd(), &mut byte)? {
        (1, Some(fd)) => Ok(fd),
        (0, _) => Err(Error::Ipc("the socket closed before a handle came".into())),
        _ => Err(Error::Ipc("a message without a descriptor".into())),
    }
}

pub(super) fn ipc_error(call: &str, err: Errno) -> Error {
    Error::Ipc(format!("{call}: {err}"))
}

pub(super) fn message(words: &[u64], text: &str) -> Vec<u8> {
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.extend_from_slice(text.as_bytes());
    out
}

/// The whole little-endian words at the start of `bytes`.
pub(super) fn words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect()
}

/// Sends one request and reads its reply: its words, or for an error
/// reply its code and text.
pub(super) fn request(conn: BorrowedFd<'_>, words_out: &[u64]) -> Result<(Vec<u64>, String)> {
    send(conn, &message(words_out, ""), None)?;
    let mut buf = [0u8; 1024];
    let (n, _) = recv(conn, &mut buf)?;
    if n == 0 {
        return Err(Error::Ipc("the exporting process is gone".into()));
    }
    if n < 8 {
        return Err(Error::Ipc(format!("a reply of {n} bytes")));
    }
    let code = words(&buf[..8])[0];
    if code == OK {
        Ok((words(&buf[..n]), String::new()))
    } else {
        Ok((vec![code], String::from_utf8_lossy(&buf[8..n]).into_owned()))
    }
}

pub(super) fn send(socket: BorrowedFd<'_>, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<()> {
    let fds = fd.as_slice();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(fds));
    }
    loop {
        match rustix::net::sendmsg(
            socket,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(_) => return Ok(()),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(ipc_error("sendmsg", e)),
        }
    }
}

/// Receives one message into `buf`: its length (0: the other end closed)
/// and the descriptor that came with it, if any (extra ones are closed).
pub(super) fn recv(socket: BorrowedFd<'_>, buf: &mut [u8]) -> Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = loop {
        match rustix::net::recvmsg(
            socket,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => break r,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(ipc_error("recvmsg", e)),
        }
    };
    let mut fd = None;
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = message {
            for received in fds {
                fd.get_or_insert(received);
            }
        }
    }
    Ok((received.bytes, fd))
}
