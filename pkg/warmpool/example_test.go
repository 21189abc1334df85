package warmpool_test

import (
	"fmt"

	"github.com/weightd/weightd/pkg/warmpool"
)

// An adapter asked for without a name is served under one derived from its
// reference: valid as a runtime model name and as a directory name.
func ExampleAdapterName() {
	name := warmpool.AdapterName("hf://acme/sql-lora@main")
	fmt.Println(name[:len(name)-8], warmpool.ValidName(name))
	// Output: sql-lora- true
}
