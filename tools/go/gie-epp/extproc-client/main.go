// Command extproc-client asks an endpoint picker which pod should serve one OpenAI request, the way Envoy does
// through its external-processing filter (envoy.service.ext_proc.v3, buffered request body): it sends the request
// headers, then the whole body, and prints the endpoint the picker chose (the x-gateway-destination-endpoint
// header mutation) as JSON: {"endpoint": "ip:port"}.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const destinationHeader = "x-gateway-destination-endpoint"

func main() {
	target := flag.String("picker", "127.0.0.1:9002", "the endpoint picker's ext-proc gRPC address")
	path := flag.String("path", "/v1/completions", "request path")
	body := flag.String("body", "", "the request's JSON body")
	requestID := flag.String("request-id", "", "x-request-id of the request")
	timeout := flag.Duration("timeout", 20*time.Second, "deadline of the exchange")
	flag.Parse()
	endpoint, err := pick(*target, *path, []byte(*body), *requestID, *timeout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "extproc-client:", err)
		os.Exit(1)
	}
	_ = json.NewEncoder(os.Stdout).Encode(map[string]string{"endpoint": endpoint})
}

func header(key, value string) *corev3.HeaderValue {
	return &corev3.HeaderValue{Key: key, RawValue: []byte(value)}
}

func pick(target, path string, body []byte, requestID string, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return "", err
	}
	headers := []*corev3.HeaderValue{
		header(":method", "POST"),
		header(":path", path),
		header(":authority", "gateway"),
		header("content-type", "application/json"),
		header("content-length", fmt.Sprint(len(body))),
	}
	if requestID != "" {
		headers = append(headers, header("x-request-id", requestID))
	}
	requests := []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: headers},
		}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: body, EndOfStream: true,
		}}},
	}
	for _, request := range requests {
		if err := stream.Send(request); err != nil {
			return "", err
		}
	}
	for {
		response, err := stream.Recv()
		if err != nil {
			return "", fmt.Errorf("no endpoint picked: %w", err)
		}
		if immediate := response.GetImmediateResponse(); immediate != nil {
			return "", fmt.Errorf("the picker answered %v: %s", immediate.GetStatus().GetCode(), immediate.GetBody())
		}
		mutation := response.GetRequestHeaders().GetResponse().GetHeaderMutation()
		for _, option := range mutation.GetSetHeaders() {
			if option.GetHeader().GetKey() == destinationHeader {
				_ = stream.CloseSend()
				return string(option.GetHeader().GetRawValue()), nil
			}
		}
	}
}
