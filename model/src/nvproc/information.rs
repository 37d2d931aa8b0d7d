//! The per-GPU `information` file,
//! `/proc/driver/nvidia/gpus/<pci bus id>/information` (its format and
//! sources are in the [`super`] module docs).

use std::path::Path;

use serde::Serialize;

use super::{dec_i32, dec_u32};
use crate::error::ParseError;

/// One GPU as its `information` file describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuProcInfo {
    /// `Model:`, the marketing name (`NVIDIA H100 80GB HBM3`).
    pub model: String,
    /// `GPU UUID:`, `GPU-<uuid>`.
    pub uuid: String,
    /// `Bus Location:`, `domain:bus:slot.function` in lower-case hex, as the
    /// driver prints it (and names the directory).
    pub bus_location: String,
    /// `Device Minor:`, the N of `/dev/nvidiaN` and the G of `gpu<G>` in the
    /// MIG capability paths.
    pub device_minor: u32,
    /// `GPU Excluded:` (`Yes`/`No`); `None` when the driver did not print it.
    pub excluded: Option<bool>,
    /// `IRQ:`.
    pub irq: Option<i32>,
    /// `Video BIOS:`.
    pub video_bios: Option<String>,
    /// `Bus Type:`, `PCIe` or `PCI`.
    pub bus_type: Option<String>,
    /// `DMA Size:` in bits.
    pub dma_size_bits: Option<u32>,
    /// `DMA Mask:`.
    pub dma_mask: Option<u64>,
    /// `GPU Firmware:` (the GSP firmware version); `None` for `N/A` or absent.
    pub firmware: Option<String>,
    /// Lines with other keys (`BAR0:` of debug builds, keys of later
    /// drivers), `(key, value)` in file order.
    pub other: Vec<(String, String)>,
}

/// Parses one `/proc/driver/nvidia/gpus/<bus id>/information` read from
/// `source` (named in errors).
///
/// # Errors
/// A [`ParseError`] naming `source` and the 1-based line for a non-empty line
/// without `Key:`, a key given twice, or a value that is not what the driver
/// prints for that key (a number, `0x<hex>`, `<n> bits`, `Yes`/`No`, a bus
/// location, an empty model or UUID). A missing `Model:`, `GPU UUID:`,
/// `Bus Location:` or `Device Minor:` line is an error at line 0 (the whole
/// file) naming the field.
pub fn parse_gpu_information(text: &str, source: &Path) -> Result<GpuProcInfo, ParseError> {
    let mut lines = InformationLines::default();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let err = |msg: String| ParseError::new(source, n, msg);
        let (key, value) = line
            .split_once(':')
            .ok_or_else(|| err(format!("expected \"<key>: <value>\", found {line:?}")))?;
        let key = key.trim();
        let value = value.trim();
        if key.is_empty() {
            return Err(err(format!("empty key in {line:?}")));
        }
        lines.take(key, value, n, source)?;
    }
    lines.finish(source)
}

/// The keys of one `information` file seen so far, each at most once.
#[derive(Default)]
struct InformationLines {
    model: Option<String>,
    uuid: Option<String>,
    bus_location: Option<String>,
    device_minor: Option<u32>,
    excluded: Option<bool>,
    irq: Option<i32>,
    video_bios: Option<String>,
    bus_type: Option<String>,
    dma_size_bits: Option<u32>,
    dma_mask: Option<u64>,
    firmware: Option<Option<String>>,
    other: Vec<(String, String)>,
}

impl InformationLines {
    /// Checks and keeps the value of line `n`, `key: value`.
    fn take(&mut self, key: &str, value: &str, n: usize, source: &Path) -> Result<(), ParseError> {
        let err = |msg: String| ParseError::new(source, n, msg);
        let nonempty = |v: &str| -> Result<String, ParseError> {
            if v.is_empty() {
                Err(err(format!("{key:?} has no value")))
            } else {
                Ok(v.to_string())
            }
        };
        match key {
            "Model" => set(&mut self.model, nonempty(value)?, key, n, source)?,
            "GPU UUID" => {
                if value.is_empty() || value.contains(char::is_whitespace) {
                    return Err(err(format!("GPU UUID {value:?} is not one word")));
                }
                set(&mut self.uuid, value.to_string(), key, n, source)?
            }
            "Bus Location" => {
                if !is_bus_location(value) {
                    return Err(err(format!(
                        "Bus Location {value:?} is not domain:bus:slot.function in hex"
                    )));
                }
                set(&mut self.bus_location, value.to_string(), key, n, source)?
            }
            "Device Minor" => {
                let m = dec_u32(value)
                    .ok_or_else(|| err(format!("Device Minor {value:?} is not a number")))?;
                set(&mut self.device_minor, m, key, n, source)?
            }
            "GPU Excluded" => {
                let b = match value {
                    "Yes" => true,
                    "No" => false,
                    _ => return Err(err(format!("GPU Excluded {value:?} is not Yes or No"))),
                };
                set(&mut self.excluded, b, key, n, source)?
            }
            "IRQ" => {
                let v =
                    dec_i32(value).ok_or_else(|| err(format!("IRQ {value:?} is not a number")))?;
                set(&mut self.irq, v, key, n, source)?
            }
            "Video BIOS" => set(&mut self.video_bios, value.to_string(), key, n, source)?,
            "Bus Type" => set(&mut self.bus_type, nonempty(value)?, key, n, source)?,
            "DMA Size" => {
                let bits = value
                    .strip_suffix("bits")
                    .map(str::trim_end)
                    .and_then(dec_u32)
                    .ok_or_else(|| err(format!("DMA Size {value:?} is not \"<n> bits\"")))?;
                set(&mut self.dma_size_bits, bits, key, n, source)?
            }
            "DMA Mask" => {
                let mask = value
                    .strip_prefix("0x")
                    .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
                    .and_then(|h| u64::from_str_radix(h, 16).ok())
                    .ok_or_else(|| err(format!("DMA Mask {value:?} is not 0x<hex>")))?;
                set(&mut self.dma_mask, mask, key, n, source)?
            }
            "GPU Firmware" => {
                let v = (value != "N/A" && !value.is_empty()).then(|| value.to_string());
                set(&mut self.firmware, v, key, n, source)?
            }
            _ => {
                if self.other.iter().any(|(k, _)| k == key) {
                    return Err(err(format!("{key:?} given twice")));
                }
                self.other.push((key.to_string(), value.to_string()));
            }
        }
        Ok(())
    }

    /// The parsed file, once every line is taken: the required keys must
    /// have been seen.
    fn finish(self, source: &Path) -> Result<GpuProcInfo, ParseError> {
        let missing = |field: &str, why: &str| {
            ParseError::new(source, 0, format!("no \"{field}:\" line{why}"))
        };
        Ok(GpuProcInfo {
            model: self.model.ok_or_else(|| missing("Model", ""))?,
            uuid: self.uuid.ok_or_else(|| {
                missing(
                    "GPU UUID",
                    " (the driver leaves it out when it cannot read the UUID)",
                )
            })?,
            bus_location: self
                .bus_location
                .ok_or_else(|| missing("Bus Location", ""))?,
            device_minor: self
                .device_minor
                .ok_or_else(|| missing("Device Minor", ""))?,
            excluded: self.excluded,
            irq: self.irq,
            video_bios: self.video_bios,
            bus_type: self.bus_type,
            dma_size_bits: self.dma_size_bits,
            dma_mask: self.dma_mask,
            firmware: self.firmware.flatten(),
            other: self.other,
        })
    }
}

/// Fills a field of [`parse_gpu_information`] once; a second line with the
/// same key is an error at line `n`.
fn set<T>(slot: &mut Option<T>, v: T, key: &str, n: usize, src: &Path) -> Result<(), ParseError> {
    if slot.is_some() {
        return Err(ParseError::new(src, n, format!("{key:?} given twice")));
    }
    *slot = Some(v);
    Ok(())
}

/// `domain:bus:slot.function`, each part hex (`%04x:%02x:%02x.%x`).
pub(super) fn is_bus_location(s: &str) -> bool {
    let hex = |p: &str, max: usize| {
        !p.is_empty() && p.len() <= max && p.bytes().all(|b| b.is_ascii_hexdigit())
    };
    let mut parts = s.split(':');
    let (Some(dom), Some(bus), Some(rest), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let Some((slot, func)) = rest.split_once('.') else {
        return false;
    };
    hex(dom, 8) && hex(bus, 2) && hex(slot, 2) && hex(func, 1)
}
