// Package nvml is weightd's view of the node's NVIDIA GPUs: each GPU's
// index, UUID, name and memory, its MIG instances, and the compute processes
// on it with the pods they belong to.
//
// It reads everything through go-nvml's nvml.Interface, so the real library
// (Open) and the mock machines of nvmltest share one code path. Every call is
// answered per device: a GPU that is lost, or that does not list its
// processes, is reported with its errors beside the others, never fatal.
// A node with no driver is normal: Open returns ErrNoDriver and the agent
// runs with its GPU features off.
package nvml
