//! The exporting side: a thread per connection that answers imports with
//! leases and chunk descriptors.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use vmm::memory::Chunk;
use vmm::Backend;

use super::wire::{
    message, pool_token, recv, send, words, ExportData, FAILED, FOREIGN, HELLO, IMPORT, OK,
    PROTOCOL, RELEASE, STALE,
};
use crate::pool::WeakPool;
use crate::{Error, Pool, Result, Stream};

/// A reply: messages, each with the chunk whose descriptor goes with it.
/// A chunk is exported as its message is sent, and its descriptor closed
/// once sent, so that this side holds one at a time however many chunks an
/// allocation spans.
type Reply<B> = Vec<(Vec<u8>, Option<Arc<Chunk<B>>>)>;

fn reply<B: Backend>(words: &[u64], text: &str) -> Reply<B> {
    vec![(message(words, text), None)]
}

/// Sends `answer`. A chunk that fails to export goes without its
/// descriptor, and so do the ones after it: the importer, finding one
/// missing, reads the rest and gives the lease back.
fn send_reply<B: Backend>(conn: BorrowedFd<'_>, answer: Reply<B>) -> Result<()> {
    let mut failed = false;
    for (bytes, chunk) in answer {
        // The chunk goes before its message does: once the importer has
        // the last one, this side holds none of them.
        let exported = chunk.filter(|_| !failed).map(|c| c.export());
        let fd = match exported {
            Some(Ok(fd)) => Some(fd),
            Some(Err(err)) => {
                tracing::warn!(%err, "exporting a chunk for an import");
                failed = true;
                None
            }
            None => None,
        };
        send(conn, &bytes, fd.as_ref().map(|f| f.as_fd()))?;
    }
    Ok(())
}

/// Serves one connection until it closes or the pool goes, then ends the
/// leases it still holds.
pub(super) fn serve<B: Backend>(pool: &WeakPool<B>, conn: &OwnedFd) {
    // Lease id -> the leased allocation's address.
    let mut leases: HashMap<u64, u64> = HashMap::new();
    let mut next_lease = 0;
    let mut buf = [0u8; 256];
    loop {
        let request = match recv(conn.as_fd(), &mut buf) {
            Ok((0, _)) | Err(_) => break,
            Ok((n, _)) => words(&buf[..n]),
        };
        let Some(pool) = pool.upgrade() else { break };
        let answer = match request.as_slice() {
            &[HELLO, version] if version != PROTOCOL => reply(
                &[FAILED],
                &format!("the importer speaks protocol {version}, this exporter {PROTOCOL}"),
            ),
            [HELLO] => reply(
                &[FAILED],
                &format!("the importer speaks protocol 1, this exporter {PROTOCOL}"),
            ),
            [HELLO, _] => match pool.backend().device_uuid(pool.device()) {
                Ok(uuid) => {
                    let (high, low) = uuid.split_at(8);
                    let word = |half: &[u8]| u64::from_be_bytes(half.try_into().expect("8 bytes"));
                    reply(
                        &[
                            OK,
                            pool_token(pool.id()),
                            u64::from(pool.device().0),
                            pool.backend().granularity(pool.device()).unwrap_or(0) as u64,
                            word(high),
                            word(low),
                        ],
                        "",
                    )
                }
                Err(err) => reply(&[FAILED], &err.to_string()),
            },
            &[IMPORT, token, serial, ptr, size] => {
                let data = ExportData {
                    token,
                    serial,
                    ptr,
                    size,
                };
                next_lease += 1;
                grant(&pool, &data, next_lease, &mut leases)
            }
            &[RELEASE, lease] => match leases.remove(&lease) {
                Some(ptr) => {
                    end_lease(&pool, ptr);
                    reply(&[OK], "")
                }
                None => reply(&[FAILED], "no such lease"),
            },
            _ => reply(&[FAILED], "unknown request"),
        };
        // Let go of the pool before answering: once answered, the other
        // side may expect everything to be as it left it, the pool gone
        // included, when this process drops it.
        drop(pool);
        if send_reply(conn.as_fd(), answer).is_err() {
            break;
        }
    }
    if leases.is_empty() {
        // Nothing to end: do not touch the pool, which this thread would
        // otherwise keep alive, for a moment, past its owner's last drop.
        return;
    }
    tracing::debug!(
        leases = leases.len(),
        "an importing process went away: its leases end"
    );
    if let Some(pool) = pool.upgrade() {
        for ptr in leases.into_values() {
            end_lease(&pool, ptr);
        }
    }
}

/// Takes a lease for an import and answers with a header, then one message
/// per chunk with its descriptor ([`send_reply`] exports them). The lease
/// is recorded before anything is sent, so that a connection that breaks
/// half-way still ends it.
fn grant<B: Backend>(
    pool: &Pool<B>,
    data: &ExportData,
    lease: u64,
    leases: &mut HashMap<u64, u64>,
) -> Reply<B> {
    let (first, chunks) = match take_lease(pool, data) {
        Ok(found) => found,
        Err(err) => {
            let code = match err {
                Error::StaleExport { .. } => STALE,
                Error::ForeignExport { .. } => FOREIGN,
                _ => FAILED,
            };
            return reply(&[code], &err.to_string());
        }
    };
    leases.insert(lease, data.ptr);
    let mut answer = reply(&[OK, lease, data.ptr - first, chunks.len() as u64], "");
    for chunk in chunks {
        answer.push((
            message(&[chunk.handle().0, chunk.size() as u64], ""),
            Some(chunk),
        ));
    }
    answer
}

/// Takes a lease on the allocation `data` names; returns its first unit's
/// address and the chunks under it.
fn take_lease<B: Backend>(pool: &Pool<B>, data: &ExportData) -> Result<(u64, Vec<Arc<Chunk<B>>>)> {
    if data.token != pool_token(pool.id()) {
        return Err(Error::ForeignExport { ptr: data.ptr });
    }
    pool.exports().lease(data.ptr, data.serial)?;
    Ok(pool.units_under(data.ptr, data.size))
}

/// Ends a lease on the allocation at `ptr`; the last one carries out a
/// free that was deferred.
fn end_lease<B: Backend>(pool: &Pool<B>, ptr: u64) {
    let Some(deferred) = pool.exports().end_lease(ptr) else {
        return;
    };
    tracing::debug!(ptr = %deferred.allocation.ptr(), "last lease ended: deferred free carried out");
    let freed = match deferred.stream {
        Some(stream) => pool.free_async(deferred.allocation, &Stream(stream)),
        None => pool.free(deferred.allocation),
    };
    if let Err(err) = freed {
        tracing::warn!(%err, "a deferred free failed");
    }
    pool.exports().deferred_done();
}
