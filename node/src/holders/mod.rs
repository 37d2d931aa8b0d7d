//! Who holds a protected device, and what covers a holder.

pub mod cover;
pub mod scan;
pub mod shm;
